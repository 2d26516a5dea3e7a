"""Cases a review found unpinned: each failed before its fix."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

from .conftest import PATH, lim, override, remaining

HOUR = 3_600_000


def test_an_expiring_override_blocks_and_hands_its_counts_to_the_limit_it_replaces(engine, install, clock):
    expires = clock.datetime + dt.timedelta(minutes=10)
    install(agent=[lim("tokens", 100, "1h"), override("tokens", 10, "1h", expires_at=expires)])
    assert engine.check(org="acme", agent="agent-1", tokens=5).allowed
    assert engine.check(org="acme", agent="agent-1", tokens=5).allowed
    refused = engine.check(org="acme", agent="agent-1", tokens=5)
    assert not refused.allowed and refused.blocked_by.limit == 10
    clock.ms = int(expires.timestamp() * 1000)  # the moment it expires, with no sync
    after = engine.check(org="acme", agent="agent-1", tokens=5)
    assert after.allowed and remaining(after, "tokens") == 100 - 15  # the override's 10 count against the 100


def test_an_override_is_settled_while_it_is_in_force(engine, install, clock):
    install(agent=[lim("tokens", 100, "1h"), override("tokens", 10, "1h", expires_at=clock.datetime.replace(
        year=clock.datetime.year + 1))])
    decision = engine.check(org="acme", agent="agent-1", tokens=2)
    engine.settle(org="acme", reservation=decision.reservation, input_tokens=4, output_tokens=4)
    assert remaining(engine.peek(org="acme", agent="agent-1"), "tokens") == 2


def test_usage_reported_for_a_check_without_an_estimate_is_counted(engine, install):
    install(org=[lim("cost", "0.05", period="day")], agent=[lim("tokens", 100, "1h")],
            prices={"gpt-4o": (Decimal("0.0025"), Decimal("0.01"))})
    decision = engine.check(org="acme", agent="agent-1", model="gpt-4o")  # no tokens estimate
    engine.settle(org="acme", reservation=decision.reservation, input_tokens=40, output_tokens=20)
    after = engine.peek(org="acme", agent="agent-1")
    assert remaining(after, "tokens") == 40
    assert remaining(after, "cost") == Decimal("0.05") - (Decimal("0.0001") + Decimal("0.0002"))


def test_a_short_lease_never_shortens_the_memory_of_a_long_one(engine, install, redis_client):
    install(user=[lim("concurrency", 2)])
    engine.lease(org="acme", agent="agent-1", ttl_s=3600)
    engine.lease(org="acme", agent="agent-1", ttl_s=1)
    assert redis_client.pttl(engine.keys.leases("acme", "user", "alice")) > 3_599_000


def test_a_token_bucket_is_remembered_until_it_has_refilled(engine, install, redis_client):
    install(agent=[lim("requests", 10, "1m", burst=50)])  # refills 10 a minute, holds 50
    assert sum(engine.check(org="acme", agent="agent-1").allowed for _ in range(50)) == 50
    # empty: 5 minutes to refill, longer than the window
    assert redis_client.pttl(engine.keys.counters("acme", "agent", "agent-1")) >= 5 * 60_000


def test_a_token_bucket_in_debt_is_remembered_until_repaid(engine, install, redis_client):
    install(agent=[lim("tokens", 1000, "1m", burst=1000)])
    decision = engine.check(org="acme", agent="agent-1", tokens=1000)
    engine.settle(org="acme", reservation=decision.reservation, input_tokens=50_000, output_tokens=0)
    assert redis_client.pttl(engine.keys.counters("acme", "agent", "agent-1")) >= 50 * 60_000


def test_settling_after_the_agent_moved_leaves_the_old_teams_counts_alone(engine, install, clock):
    team = [lim("requests", 5, "1h"), lim("tokens", 1000, "1h")]
    install(team=team, path=("acme", "eng", "bob", "agent-2"))
    install(team=team, path=PATH)
    for _ in range(4):
        assert engine.check(org="acme", agent="agent-2").allowed
    decision = engine.check(org="acme", agent="agent-1", tokens=100)
    assert remaining(decision, "requests", "team") == 0
    # agent-1 moves to team ops (no requests limit there), then reports its usage
    install(team=[lim("tokens", 500, "1h")], path=("acme", "ops", "alice", "agent-1"))
    engine.settle(org="acme", reservation=decision.reservation, input_tokens=10, output_tokens=0)
    assert remaining(engine.peek(org="acme", agent="agent-2"), "requests", "team") == 0
