"""check and peek: every limit on the path, charged all together or not at all."""

from __future__ import annotations

from decimal import Decimal

import pytest

from quotas.engine import PolicyNotLoaded, UnknownAgent
from quotas.engine.compile import limit_id
from quotas.engine.usage import UsageEvent, parse_event

from .conftest import lim, remaining


def test_an_admitted_check_charges_every_level(engine, install):
    install(org=[lim("tokens", 1000, "1h")], team=[lim("tokens", 800, "1h")], user=[lim("tokens", 600, "1h")],
            agent=[lim("tokens", 400, "1h"), lim("requests", 10, "1m")])
    decision = engine.check(org="acme", agent="agent-1", tokens=100)
    assert decision.allowed and decision.reservation
    assert [(l.level, l.metric, l.remaining) for l in decision.limits] == [
        ("org", "tokens", 900), ("team", "tokens", 700), ("user", "tokens", 500),
        ("agent", "tokens", 300), ("agent", "requests", 9),
    ]
    assert [l.node for l in decision.limits] == ["acme", "eng", "alice", "agent-1", "agent-1"]


def test_a_check_refused_by_one_level_charges_no_other(engine, install):
    install(org=[lim("tokens", 1000, "1h"), lim("requests", 100, "1h")], user=[lim("tokens", 250, "1h")],
            agent=[lim("requests", 5, "1m")])
    assert engine.check(org="acme", agent="agent-1", tokens=200).allowed
    before = engine.peek(org="acme", agent="agent-1")
    refused = engine.check(org="acme", agent="agent-1", tokens=100)  # user has 50 left
    assert not refused.allowed
    assert (refused.blocked_by.level, refused.blocked_by.node, refused.blocked_by.metric) == ("user", "alice", "tokens")
    assert refused.reservation is None
    after = engine.peek(org="acme", agent="agent-1")
    assert [l.remaining for l in after.limits] == [l.remaining for l in before.limits]
    assert remaining(after, "requests", "org") == 99 and remaining(after, "requests", "agent") == 4


def test_peek_consumes_nothing_and_lists_concurrency(engine, install):
    install(user=[lim("concurrency", 3)], agent=[lim("requests", 2, "1m")])
    for _ in range(5):
        peek = engine.peek(org="acme", agent="agent-1")
    assert peek.allowed
    assert [(l.metric, l.remaining, l.window) for l in peek.limits] == [("concurrency", 3, None), ("requests", 2, "1m")]


def test_tool_weights_are_credits_and_unknown_tools_cost_one(engine, install):
    install(agent=[lim("credits", 10, "1m")])
    assert [engine.check(org="acme", agent="agent-1", tool="llm_call").allowed for _ in range(4)] == [True, True, True, False]
    assert engine.check(org="acme", agent="agent-1", tool="something-new").allowed  # 9 + 1 = 10
    assert not engine.check(org="acme", agent="agent-1", tool="something-new").allowed


def test_limits_narrowed_to_a_tool_or_model_apply_only_to_it(engine, install):
    install(agent=[lim("requests", 2, "5m", tool="delete_record"), lim("tokens", 100, "1h", model="gpt-4o")])
    assert engine.check(org="acme", agent="agent-1", tool="delete_record").allowed
    assert engine.check(org="acme", agent="agent-1", tool="delete_record").allowed
    refused = engine.check(org="acme", agent="agent-1", tool="delete_record")
    assert not refused.allowed and refused.blocked_by.tool == "delete_record"
    assert engine.check(org="acme", agent="agent-1", tool="web_search").allowed
    assert engine.check(org="acme", agent="agent-1", model="other", tokens=5000).allowed
    assert not engine.check(org="acme", agent="agent-1", model="gpt-4o", tokens=101).allowed
    assert [l.metric for l in engine.check(org="acme", agent="agent-1", tool="web_search").limits] == []


def test_shadow_limits_never_block_but_report(engine, install):
    install(agent=[lim("requests", 1, "1m", shadow=True), lim("requests", 5, "1h")])
    first = engine.check(org="acme", agent="agent-1")
    second = engine.check(org="acme", agent="agent-1")
    assert first.allowed and first.would_block == []
    assert second.allowed and [(l.metric, l.window, l.shadow) for l in second.would_block] == [("requests", "1m", True)]


def test_retry_after_is_the_earliest_time_the_same_request_passes(engine, install, clock):
    install(agent=[lim("requests", 3, "10s")])
    for _ in range(3):
        assert engine.check(org="acme", agent="agent-1").allowed
        clock.advance(1500)
    refused = engine.check(org="acme", agent="agent-1")
    assert not refused.allowed and refused.retry_after_ms > 0
    clock.advance(refused.retry_after_ms - 1)
    assert not engine.check(org="acme", agent="agent-1").allowed
    clock.advance(1)
    assert engine.check(org="acme", agent="agent-1").allowed


def test_a_request_larger_than_the_limit_can_never_pass(engine, install):
    install(agent=[lim("tokens", 100, "1h")])
    refused = engine.check(org="acme", agent="agent-1", tokens=101)
    assert not refused.allowed and refused.retry_after_ms is None


def test_the_latest_blocking_limit_is_named(engine, install, clock):
    install(org=[lim("requests", 1, "1h")], agent=[lim("requests", 1, "1m")])
    engine.check(org="acme", agent="agent-1")
    refused = engine.check(org="acme", agent="agent-1")
    assert (refused.blocked_by.level, refused.blocked_by.window) == ("org", "1h")
    assert refused.retry_after_ms > 60_000


def test_unknown_agent_and_org_are_named(engine, install):
    install(agent=[lim("requests", 1, "1m")])
    with pytest.raises(UnknownAgent, match="unknown agent 'agent-9' in org 'acme'"):
        engine.check(org="acme", agent="agent-9")
    with pytest.raises(PolicyNotLoaded, match="policy of org 'globex' is not in Redis"):
        engine.check(org="globex", agent="agent-1")


def test_a_moved_agent_is_followed(engine, install):
    install(user=[lim("requests", 1, "1h")], agent=[lim("requests", 5, "1h")])
    assert engine.check(org="acme", agent="agent-1").allowed
    # the agent moves to bob: its next check is counted on bob, not alice (the engine learns the new path)
    install(user=[lim("requests", 1, "1h")], agent=[lim("requests", 5, "1h")], path=("acme", "eng", "bob", "agent-1"),
            forget_paths=False)
    decision = engine.check(org="acme", agent="agent-1")
    assert decision.allowed and decision.limits[0].node == "bob"


def test_counters_get_a_ttl_so_idle_agents_cost_nothing(engine, install, redis_client):
    install(org=[lim("cost", 5, period="day")], agent=[lim("requests", 5, "1m"), lim("tokens", 10, "1h", burst=20)])
    engine.check(org="acme", agent="agent-1", model="gpt-4o", tokens=5)
    counters = [engine.keys.counters("acme", level, node) for level, node in zip(("org", "agent"), ("acme", "agent-1"))]
    ttls = [redis_client.pttl(key) for key in counters]
    assert all(ttl > 0 for ttl in ttls)
    assert ttls[1] <= 3600_000 + 1000  # the longest of the agent's windows, plus a second


def test_a_server_without_the_functions_gets_them_loaded(engine, install, redis_client):
    install(agent=[lim("requests", 2, "1m")])
    assert engine.check(org="acme", agent="agent-1").allowed
    redis_client.function_flush()  # as on a new server, or a restarted one without persistence
    assert engine.check(org="acme", agent="agent-1").allowed
    assert not engine.check(org="acme", agent="agent-1").allowed


def test_a_batch_on_a_server_without_the_functions_gets_them_loaded(engine, install, redis_client):
    install(agent=[lim("requests", 2, "1m")])
    assert engine.check(org="acme", agent="agent-1").allowed
    redis_client.function_flush()
    results = engine.check_many(org="acme", checks=[{"agent": "agent-1"}, {"agent": "agent-1"}])
    assert [result.allowed for result in results] == [True, False]  # each call answered once, in order


def test_every_admitted_check_appends_a_usage_event(engine, install, redis_client, clock):
    install(agent=[lim("requests", 1, "1m")])
    decision = engine.check(org="acme", agent="agent-1", tool="llm_call", model="gpt-4o", tokens=1000)
    engine.check(org="acme", agent="agent-1", tool="llm_call")
    events = [parse_event(fields) for _, fields in redis_client.xrange(engine.keys.usage_stream("acme"))]
    assert events[0] == UsageEvent(
        kind="check", org="acme", team="eng", user="alice", agent="agent-1", tool="llm_call", model="gpt-4o",
        requests=1, credits=3, tokens=1000, input_tokens=0, output_tokens=0, cost=Decimal("0.01"), est_tokens=0,
        est_cost=Decimal(0), ts_ms=clock.ms, reservation=decision.reservation, unsettled=False,
    )
    assert (events[1].kind, events[1].requests, events[1].tool) == ("deny", 0, "llm_call")


def test_limit_ids_survive_an_amount_edit_but_not_a_change_of_what_is_counted():
    assert limit_id(lim("tokens", 100, "1h")) == limit_id(lim("tokens", 999, "1h"))
    assert limit_id(lim("tokens", 100, "1h")) != limit_id(lim("tokens", 100, "1h", burst=10))
    assert limit_id(lim("tokens", 100, "1h")) != limit_id(lim("tokens", 100, "1h", tool="x"))


def test_tokens_are_validated(engine, install):
    install(agent=[lim("requests", 2, "1m")])
    for bad in (-1, 10**9 + 1, 1.5, "5", True):
        with pytest.raises(ValueError, match="tokens must be a whole number from 0 to 1000000000"):
            engine.check(org="acme", agent="agent-1", tokens=bad)
    assert engine.check(org="acme", agent="agent-1", tokens=10**9).allowed


def test_a_narrow_call_never_cuts_the_memory_of_a_longer_limit_short(engine, install, redis_client, clock):
    """The counter hash lives as long as the longest limit of its level, whatever the call's tool."""
    install(agent=[lim("requests", 2, "1h", tool="delete_record"), lim("requests", 100, "5m")])
    engine.check(org="acme", agent="agent-1", tool="delete_record")
    engine.check(org="acme", agent="agent-1", tool="delete_record")
    for _ in range(3):  # general calls in later buckets of the 5-minute window
        clock.advance(40_000)
        engine.check(org="acme", agent="agent-1", tool="web_search")
    assert redis_client.pttl(engine.keys.counters("acme", "agent", "agent-1")) > 3_500_000
    clock.advance(30 * 60_000)
    assert not engine.check(org="acme", agent="agent-1", tool="delete_record").allowed


def test_server_time_is_used_when_no_clock_is_given(engine, install, redis_client):
    import time

    install(agent=[lim("requests", 5, "1m")])
    engine.clock = None
    before = int(time.time() * 1000)
    engine.check(org="acme", agent="agent-1")
    after = int(time.time() * 1000)
    (entry_id, fields), = redis_client.xrange(engine.keys.usage_stream("acme"))
    event = parse_event(fields)
    assert before - 1000 <= event.ts_ms <= after + 1000  # the same machine's clock, give or take
    assert abs(event.ts_ms - int(entry_id.split("-")[0])) <= 1  # the stream id is also server time


def test_check_many_decides_each_on_its_own_in_one_round_trip(engine, install):
    install(agent=[lim("requests", 2, "1m")])
    install(agent=[lim("requests", 1, "1m")], path=("acme", "eng", "bob", "agent-2"))
    results = engine.check_many(org="acme", checks=[
        {"agent": "agent-1"}, {"agent": "agent-2", "tool": "llm_call", "tokens": 5}, {"agent": "agent-2"},
        {"agent": "agent-9"}, {"agent": "agent-1"}, {"agent": "agent-1"},
    ])
    assert [getattr(result, "allowed", type(result).__name__) for result in results] == [
        True, True, False, "UnknownAgent", True, False,
    ]
    assert results[2].blocked_by.node == "agent-2" and results[2].retry_after_ms > 0
    assert results[1].reservation.endswith(".eng.bob.agent-2")
    # the same checks one by one would now be refused: the batch charged what it admitted
    assert not engine.check(org="acme", agent="agent-1").allowed


def test_names_that_would_break_records_are_refused(engine, install):
    install(agent=[lim("requests", 5, "1m")])
    for kwargs in ({"tool": "a|b"}, {"model": "gpt 4"}, {"agent": "agent-1|x"}, {"tool": "x\n"}):
        with pytest.raises(ValueError, match="is not a valid name"):
            engine.check(org="acme", **{"agent": "agent-1", **kwargs})
    assert engine.check(org="acme", agent="agent-1", tool="web_search", model="openai/gpt-4o@2024").allowed


def test_a_known_policy_is_not_sent_again_whatever_its_version_looks_like(engine, install, monkeypatch):
    """Policy sync's versions are microseconds (16 digits): Lua prints those with an exponent."""
    install(agent=[lim("requests", 5, "1m")], version=1_795_000_000_123_456)
    learnt = []
    original = engine._learn
    monkeypatch.setattr(engine, "_learn", lambda *args: learnt.append(args) or original(*args))
    for _ in range(3):
        assert engine.check(org="acme", agent="agent-1").allowed
    assert len(learnt) == 1  # the first answer (path unknown yet); not once per check


def test_ids_are_random_hex_and_a_forked_child_draws_its_own():
    import os

    from quotas.engine.ids import random_hex

    ids = {random_hex(8) for _ in range(5000)}  # across several 4 KiB reads of os.urandom
    assert len(ids) == 5000 and all(len(i) == 16 and int(i, 16) >= 0 for i in ids)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        os.write(write, random_hex(8).encode())
        os._exit(0)
    os.waitpid(child, 0)
    # the parent's read-ahead is the child's too, unless the child starts afresh: same next id
    assert os.read(read, 16).decode() != random_hex(8)
