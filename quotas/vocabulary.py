"""The product's vocabulary: levels, metrics, windows and periods.

Pure Python (no Django import): the models, the policy file and the engine
all speak it.
"""

from __future__ import annotations

import re
from enum import StrEnum


class Level(StrEnum):
    ORG = "org"
    TEAM = "team"
    USER = "user"
    AGENT = "agent"


LEVELS_TOP_DOWN: tuple[Level, ...] = (Level.ORG, Level.TEAM, Level.USER, Level.AGENT)


class Metric(StrEnum):
    REQUESTS = "requests"  # 1 per call
    CREDITS = "credits"  # the tool's weight
    TOKENS = "tokens"  # estimated, then settled
    COST = "cost"  # USD, from the model's price
    CONCURRENCY = "concurrency"  # leases held at once


class Period(StrEnum):
    DAY = "day"
    MONTH = "month"


# Metrics whose amounts are money (decimal); the others count whole units.
MONEY_METRICS = frozenset({Metric.COST})

# Ids of nodes, tiers and tools, and model names: they end up in Redis keys and `|`-separated records.
SLUG_PATTERN = r"[a-z0-9](?:[a-z0-9_-]{0,62}[a-z0-9])?"
MODEL_PATTERN = r"[A-Za-z0-9](?:[A-Za-z0-9._/@+-]{0,98}[A-Za-z0-9])?"
SLUG_RE = re.compile(SLUG_PATTERN)  # use with fullmatch
MODEL_RE = re.compile(MODEL_PATTERN)

_WINDOW_RE = re.compile(r"^\s*([1-9][0-9]*)\s*([smhd])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
WINDOW_HINT = "use 30s, 5m, 1h or 1d"
# The longest rolling window: longer spans are what calendar periods are for.
MAX_WINDOW_SECONDS = 31 * 86400


class VocabularyError(ValueError):
    """A value that is not in the vocabulary; the message says how to fix it."""


def parse_window(value: object) -> int:
    """'5m' -> 300. Whole seconds, minutes, hours or days."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise VocabularyError(f"{value!r} is not a window; {WINDOW_HINT}")
    match = _WINDOW_RE.match(value)
    if not match:
        raise VocabularyError(f"{value!r} is not a window; {WINDOW_HINT}")
    seconds = int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if seconds > MAX_WINDOW_SECONDS:
        raise VocabularyError(
            f"{value!r} is longer than 31 days; use period: month for a calendar budget"
        )
    return seconds


def format_window(seconds: int) -> str:
    """300 -> '5m': the largest unit that divides the window exactly."""
    for unit in ("d", "h", "m"):
        size = _UNIT_SECONDS[unit]
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def choices(enum: type[StrEnum]) -> str:
    return ", ".join(member.value for member in enum)
