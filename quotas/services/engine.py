"""The process's QuotaEngine, configured from Django settings."""

from __future__ import annotations

from functools import cache

import redis
from django.conf import settings

from quotas.engine import QuotaEngine


@cache
def get_engine() -> QuotaEngine:
    from quotas.services.policy_sync import policy_sync_org_by_slug

    return QuotaEngine.from_url(
        settings.QUOTAS_REDIS_URL,
        connect_timeout_ms=settings.QUOTAS_REDIS_CONNECT_TIMEOUT_MS,
        read_timeout_ms=settings.QUOTAS_REDIS_READ_TIMEOUT_MS,
        key_prefix=settings.QUOTAS_REDIS_KEY_PREFIX,
        reservation_ttl_s=settings.QUOTAS_RESERVATION_TTL_S,
        fail_mode=settings.QUOTAS_FAIL_MODE,
        on_policy_missing=policy_sync_org_by_slug,
    )


@cache
def get_batch_redis() -> redis.Redis:
    """A client for batch work (the drain): the hot path's read timeout is too short for a read of
    thousands of stream entries on a busy server."""
    return redis.Redis.from_url(
        settings.QUOTAS_REDIS_URL,
        socket_connect_timeout=settings.QUOTAS_REDIS_CONNECT_TIMEOUT_MS / 1000,
        socket_timeout=30,
        decode_responses=True,
    )
