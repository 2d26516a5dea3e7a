"""The packed counter state (lua/lib.lua): a check rewrites a window's record from its old bytes when it
only charges the newest bucket, and unpacks the ring only when it must. The records must stay whole
and agree with what the checks report, whichever way they were written."""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import FakeClock, lim

SLOTS = 11
SIZES = {b"w": 9 + 8 * (2 + SLOTS), b"b": 25, b"p": 25}


def records(client, key) -> dict[bytes, tuple]:
    """id -> (kind, numbers) of a node's state, read as lib.lua lays it out."""
    packed = client.execute_command("GET", key, NEVER_DECODE=True) or b""
    out, pos = {}, 0
    while pos < len(packed):
        kind = packed[pos + 8:pos + 9]
        size = SIZES[kind]
        out[packed[pos:pos + 8]] = (kind, struct.unpack(f"<{(size - 9) // 8}d", packed[pos + 9:pos + size]))
        pos += size
    assert pos == len(packed), "records do not fill the state exactly"
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 3000), st.sampled_from([None, "web_search", "llm_call"]),
                          st.integers(0, 40), st.booleans()), min_size=1, max_size=60))
def test_window_records_stay_whole_whichever_way_a_check_writes_them(engine, install, calls):
    clock = FakeClock()
    engine.clock = clock
    install(user=[lim("tokens", 400, "10s"), lim("requests", 50, "1m", tool="web_search")],
            agent=[lim("tokens", 300, "5s"), lim("requests", 30, "10s", tool="llm_call"),
                   lim("credits", 20, "10s", burst=20), lim("tokens", 5000, period="day")])
    keys = [engine.keys.counters("acme", level, node) for level, node in (("user", "alice"), ("agent", "agent-1"))]
    for key in keys:
        engine.client.delete(key)
    for gap, tool, tokens, settle in calls:
        clock.advance(gap)
        before = {key: records(engine.client, key) for key in keys}
        decision = engine.check(org="acme", agent="agent-1", tool=tool, tokens=tokens)
        if decision.allowed and settle:
            engine.settle(org="acme", reservation=decision.reservation, input_tokens=tokens // 2, output_tokens=0)
        peek = {(limit.level, limit.metric, limit.tool): limit for limit in engine.peek(org="acme", agent="agent-1").limits}
        for key in keys:
            after = records(engine.client, key)
            for ident, (kind, values) in after.items():
                if kind != b"w":
                    continue
                newest, total, ring = values[0], values[1], values[2:]
                assert total == sum(ring), "a window's total is the sum of its ring"
                assert all(count >= 0 for count in ring)
            if not decision.allowed:
                assert after == before[key], "a refused check writes nothing"
        # what a window reports as remaining is what its ring holds for the buckets still in the window
        for (level, metric, tool_of), limit in peek.items():
            if limit.window in ("10s", "5s", "1m") and metric != "credits":
                key = keys[0] if level == "user" else keys[1]
                kind, values = records(engine.client, key).get(limit.id.encode(), (b"w", (-1, 0) + (0,) * SLOTS))
                window_ms = {"5s": 5000, "10s": 10_000, "1m": 60_000}[limit.window]
                g = window_ms // 10
                newest, ring = int(values[0]), values[2:]
                oldest = (clock.ms - window_ms) // g
                used = sum(ring[b % SLOTS] for b in range(max(oldest, newest - 10), newest + 1)) if newest >= 0 else 0
                assert limit.remaining == limit.limit - used
