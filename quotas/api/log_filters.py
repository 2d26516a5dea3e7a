"""Logging filters for the API."""

import logging


class SkipRefusals(logging.Filter):
    """Refused checks (429) are the API working as designed: not a warning each."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "status_code", None) != 429
