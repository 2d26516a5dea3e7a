"""Leases: a slot in every concurrency limit on the path, or none; they expire unless renewed."""

from __future__ import annotations

import pytest

from quotas.engine import QuotaExceeded, UnknownLease

from .conftest import lim


def test_a_lease_takes_a_slot_at_every_level_or_none(engine, install):
    install(org=[lim("concurrency", 3)], user=[lim("concurrency", 2)])
    first = engine.lease(org="acme", agent="agent-1", ttl_s=60)
    second = engine.lease(org="acme", agent="agent-1", ttl_s=60)
    with pytest.raises(QuotaExceeded) as refused:
        engine.lease(org="acme", agent="agent-1", ttl_s=60)
    assert refused.value.blocked_by.level == "user"
    peek = engine.peek(org="acme", agent="agent-1")
    assert [(l.level, l.remaining) for l in peek.limits] == [("org", 1), ("user", 0)]  # the refusal took nothing
    first.release()
    assert [(l.level, l.remaining) for l in engine.peek(org="acme", agent="agent-1").limits] == [("org", 2), ("user", 1)]
    second.release()


def test_a_lease_not_renewed_expires_by_itself(engine, install, clock):
    install(user=[lim("concurrency", 1)])
    lease = engine.lease(org="acme", agent="agent-1", ttl_s=5)  # the agent then crashes
    with pytest.raises(QuotaExceeded) as refused:
        engine.lease(org="acme", agent="agent-1", ttl_s=5)
    assert refused.value.retry_after_ms == 5000
    clock.advance(5000)
    assert engine.lease(org="acme", agent="agent-1", ttl_s=5)
    with pytest.raises(UnknownLease):
        lease.renew()


def test_renew_keeps_the_slot(engine, install, clock):
    install(user=[lim("concurrency", 1)])
    with engine.lease(org="acme", agent="agent-1", ttl_s=5) as lease:
        clock.advance(4000)
        lease.renew(ttl_s=5)
        clock.advance(4000)
        with pytest.raises(QuotaExceeded):
            engine.lease(org="acme", agent="agent-1", ttl_s=5)
    assert engine.lease(org="acme", agent="agent-1", ttl_s=5)  # released on leaving the block


def test_lease_waits_for_a_slot_within_its_timeout(engine, install, clock):
    install(user=[lim("concurrency", 1)])
    engine.lease(org="acme", agent="agent-1", ttl_s=2)
    start = clock.ms
    lease = engine.lease(org="acme", agent="agent-1", ttl_s=2, timeout=5)
    assert 2000 <= clock.ms - start < 2300 and lease.id


def test_release_is_idempotent(engine, install):
    install(user=[lim("concurrency", 1)])
    lease = engine.lease(org="acme", agent="agent-1")
    assert lease.release() is True
    assert lease.release() is False
    assert engine.lease_release(org="acme", lease=lease.id) is False


def test_shadow_concurrency_never_refuses(engine, install):
    install(user=[lim("concurrency", 1, shadow=True)])
    engine.lease(org="acme", agent="agent-1")
    assert engine.lease(org="acme", agent="agent-1")
