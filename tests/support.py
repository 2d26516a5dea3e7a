"""Helpers shared by test modules."""

from __future__ import annotations

from quotas.api.auth import forget_cached_keys
from quotas.services.engine import get_engine


def clean_redis() -> None:
    """Delete this test run's Redis keys (its random prefix only) and forget what the process cached."""
    engine = get_engine()
    keys = list(engine.client.scan_iter(engine.keys.everything(), count=1000))
    if keys:
        engine.client.delete(*keys)
    engine.forget_paths()
    forget_cached_keys()
