"""A batch (check_batch.lua) decides as the same checks made one by one (check.lua) at the same time.

The batch reads each node's state once, keeps an agent's records unpacked while its checks follow one
another, packs them when another agent's check reads the same node, and writes each node once at the
end. Every answer, the stored state (byte for byte), its TTL, the usage events and the reservations must
come out as the one-by-one checks leave them, on four agents that share an org, teams and a user.
"""

from __future__ import annotations

import secrets
from decimal import Decimal

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotas.engine import Keys, QuotaEngine
from quotas.engine.usage import parse_event

from .conftest import FakeClock, Installer, lim

PATHS = [("acme", "eng", "alice", "agent-1"), ("acme", "eng", "alice", "agent-2"),
         ("acme", "eng", "bob", "agent-3"), ("acme", "ops", "carol", "agent-4")]
TOOLS = ["", "web_search", "llm_call", "delete_record"]


def policy(small: int):
    """Limits on every level, of every kind, some small enough to refuse: windows (whole and not),
    token buckets, calendar periods, limits of a tool, a shadow limit."""
    return {
        "org": [lim("requests", 40 * small, "1m"), lim("tokens", 400 * small, "1h"), lim("cost", "0.05", period="day")],
        "team": [lim("tokens", 150 * small, "10s")],
        "user": [lim("requests", 6 * small, "7s"), lim("requests", small, "1m", tool="delete_record"),
                 lim("tokens", 50, "1h", shadow=True), lim("requests", 30, period="month")],
        # a bucket only some calls draw, with a burst far above its rate: the node's TTL (time to refill)
        # is the last renewing check's, whether or not that check drew it
        "agent": [lim("credits", 4 * small, "10s", burst=5 * small), lim("tokens", 1, "10s", burst=10_000, tool="llm_call")],
    }


def engines(redis_client, clock):
    """Two engines on keys of their own. Without the sweep: a batch sweeps once, before its first
    check, where one-by-one checks sweep each in turn (the expire events land elsewhere in the stream)."""
    return [QuotaEngine(redis_client, key_prefix=f"aqt{secrets.token_hex(4)}", clock=clock, sleep=clock.sleep,
                        sweep_per_check=0) for _ in range(2)]


def answer(decision):
    return (decision.allowed, decision.retry_after_ms, decision.blocked_by and decision.blocked_by.id,
            [(l.level, l.node, l.metric, l.remaining, l.reset_ms, l.passed) for l in decision.limits])


def stored(engine: QuotaEngine):
    """What checks leave behind: each node's state (bytes), the usage events without their reservation
    ids, the reservation records, the queue's length."""
    client, keys = engine.client, engine.keys
    nodes = {(level, node): client.execute_command("GET", keys.counters("acme", level, node), NEVER_DECODE=True)
             for path in PATHS for level, node in zip(("org", "team", "user", "agent"), path)}
    events = []
    for _, fields in client.xrange(keys.usage_stream("acme")):
        e = parse_event(fields)
        events.append((e.kind, e.agent, e.tool, e.model, e.requests, e.credits, e.tokens, e.cost, e.est_tokens,
                       e.ts_ms, e.unsettled, bool(e.reservation)))
    records = sorted(client.hvals(keys.reservations("acme")))  # id -> record: the records hold no id
    return nodes, events, records, client.llen(keys.reservation_queue("acme"))


def ttls(engine: QuotaEngine) -> list[int]:
    return [engine.client.pttl(engine.keys.counters("acme", level, node))
            for path in PATHS for level, node in zip(("org", "team", "user", "agent"), path)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    small=st.integers(1, 4),
    rounds=st.lists(st.tuples(
        st.integers(0, 9000),  # ms since the round before
        st.lists(st.tuples(st.integers(0, 3), st.sampled_from(TOOLS), st.sampled_from(["", "gpt-4o"]),
                           st.integers(0, 60)), min_size=1, max_size=25)),
        min_size=1, max_size=6),
)
def test_a_batch_decides_as_its_checks_one_by_one(redis_client, small, rounds):
    clock = FakeClock()
    batched, single = engines(redis_client, clock)
    try:
        for engine in (batched, single):
            install = Installer(engine, clock)
            for path in PATHS:
                install(path=path, **policy(small))
        for gap, calls in rounds:
            clock.advance(gap)
            checks = [{"agent": PATHS[a][3], "tool": tool or None, "model": model or None, "tokens": tokens}
                      for a, tool, model, tokens in calls]
            got = batched.check_many(org="acme", checks=checks)
            want = [single.check(org="acme", **check) for check in checks]
            assert [answer(d) for d in got] == [answer(d) for d in want]
            assert stored(batched) == stored(single)
            for a, b in zip(ttls(batched), ttls(single)):  # the same PX, read a moment apart
                assert (a < 0 and a == b) or (a >= 0 and b >= 0 and abs(a - b) < 1000), (a, b)
            # settlements find what the batch recorded as the single checks' records
            for engine, decisions in ((batched, got), (single, want)):
                for n, decision in enumerate(decisions):
                    if decision.allowed and n % 3 == 0:
                        engine.settle(org="acme", reservation=decision.reservation, input_tokens=n, output_tokens=7)
            assert stored(batched) == stored(single)
        assert [answer(batched.peek(org="acme", agent=p[3], tool=t or None)) for p in PATHS for t in TOOLS] == \
            [answer(single.peek(org="acme", agent=p[3], tool=t or None)) for p in PATHS for t in TOOLS]
    finally:
        for engine in (batched, single):
            found = list(redis_client.scan_iter(Keys(engine.keys.prefix).everything(), count=1000))
            if found:
                redis_client.delete(*found)


def test_one_agents_checks_in_a_row_each_see_the_ones_before(engine, install, redis_client):
    """The records an agent's checks keep unpacked between them: the newest bucket's patch counts every
    charge, and a refusal that unpacks the ring keeps it (the stored record has all of them)."""
    install(agent=[lim("tokens", 10, "1m"), lim("requests", 100, "1m")])
    results = engine.check_many(org="acme", checks=[{"agent": "agent-1", "tokens": 4}] * 3)
    assert [d.allowed for d in results] == [True, True, False]
    assert results[2].retry_after_ms > 0
    after = engine.check(org="acme", agent="agent-1", tokens=0)
    assert [(l.metric, l.remaining) for l in after.limits] == [("tokens", 2), ("requests", 97)]


def test_a_batch_sweeps_overdue_reservations_once_for_all_its_checks(redis_client, prefix, clock, install):
    engine = QuotaEngine(redis_client, key_prefix=prefix, clock=clock, sweep_per_check=1, reservation_ttl_s=5)
    install.engine = engine
    install(agent=[lim("requests", 100, "1m")])
    first = engine.check_many(org="acme", checks=[{"agent": "agent-1"}] * 3)
    clock.advance(5000)
    engine.check_many(org="acme", checks=[{"agent": "agent-1"}] * 3)  # sweeps up to 1 per check: all 3
    kinds = [parse_event(fields).kind for _, fields in redis_client.xrange(engine.keys.usage_stream("acme"))]
    assert kinds == ["check"] * 3 + ["expire"] * 3 + ["check"] * 3
    records = redis_client.hmget(engine.keys.reservations("acme"), [d.reservation for d in first])
    assert [record.split("|")[0] for record in records] == ["x", "x", "x"]


def test_a_batch_that_fails_half_way_writes_nothing(engine, install, redis_client):
    """Every write waits until every check is decided: a script error (here a corrupt price) leaves no
    events without their charges and reservations."""
    install(agent=[lim("requests", 100, "1m")])
    engine.check(org="acme", agent="agent-1")
    before = {key: redis_client.dump(key) for key in redis_client.scan_iter(f"{engine.keys.prefix}:*")}
    redis_client.hset(engine.keys.org_policy("acme"), "m:bad", "1.5,2")
    before[engine.keys.org_policy("acme")] = redis_client.dump(engine.keys.org_policy("acme"))
    with pytest.raises(redis.ResponseError):
        engine.check_many(org="acme", checks=[{"agent": "agent-1"}, {"agent": "agent-1", "model": "bad"}])
    assert {key: redis_client.dump(key) for key in redis_client.scan_iter(f"{engine.keys.prefix}:*")} == before
