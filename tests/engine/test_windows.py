"""Rolling windows without boundary bursts, token buckets, calendar periods."""

from __future__ import annotations

import datetime as dt

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import START_MS, FakeClock, lim, remaining


def test_no_boundary_burst(engine, install, clock):
    """A fixed window lets L in at the end of one window and L more at the start of the next; we do not."""
    install(agent=[lim("requests", 10, "1m")])
    clock.ms = (START_MS // 60_000 + 1) * 60_000 - 1000  # one second before a minute boundary
    assert all(engine.check(org="acme", agent="agent-1").allowed for _ in range(10))
    clock.advance(2000)  # one second after it
    assert not engine.check(org="acme", agent="agent-1").allowed
    clock.advance(58_000 + 6_000)  # a full window (plus one bucket) later the ten have left
    assert engine.check(org="acme", agent="agent-1").allowed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    window_s=st.sampled_from([1, 10, 60]),
    limit=st.integers(1, 20),
    arrivals=st.lists(st.tuples(st.integers(0, 4000), st.integers(1, 6)), min_size=1, max_size=120),
)
def test_a_rolling_window_never_admits_more_than_the_limit_in_any_window(engine, install, window_s, limit, arrivals):
    """Random arrival gaps (ms) and token amounts: for every admitted call, the admitted total of the
    window-long interval ending at it is at most the limit (the worst interval ends at an admission)."""
    clock = FakeClock()
    engine.clock = clock
    install(agent=[lim("tokens", limit, f"{window_s}s")])
    engine.client.delete(engine.keys.counters("acme", "agent", "agent-1"))
    window_ms = window_s * 1000
    admitted: list[tuple[int, int]] = []
    for gap, amount in arrivals:
        clock.advance(gap)
        if engine.check(org="acme", agent="agent-1", tokens=amount).allowed:
            admitted.append((clock.ms, amount))
    for t, _ in admitted:
        assert sum(x for s, x in admitted if t - window_ms < s <= t) <= limit
    # and it does admit: the first call that fits always passes
    first = next((amount for _, amount in arrivals if amount <= limit), None)
    assert first is None or admitted


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    window_s=st.sampled_from([1, 10, 60]),
    limit=st.integers(1, 20),
    arrivals=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 8)), min_size=1, max_size=80),
)
def test_a_rolling_window_answers_as_its_model(engine, install, window_s, limit, arrivals):
    """Every answer (allowed, remaining, reset_ms, retry_after_ms) equals a model of the sub-window
    buckets: a window of w ms counts in buckets of g = w / 10 ms, and at `now` counts every bucket from
    (now - w) // g to now // g whole. Pins check.lua's inline path for a charge to the newest bucket
    to the general one (evaluate() in lib.lua) that every other case takes."""
    clock = FakeClock()
    engine.clock = clock
    install(agent=[lim("tokens", limit, f"{window_s}s")])
    engine.client.delete(engine.keys.counters("acme", "agent", "agent-1"))
    w = window_s * 1000
    g = w // 10
    buckets: dict[int, int] = {}  # bucket -> tokens admitted in it
    for gap, x in arrivals:
        clock.advance(gap)
        now = clock.ms
        slot, oldest = now // g, (now - w) // g
        used = sum(amount for b, amount in buckets.items() if b >= oldest)
        decision = engine.check(org="acme", agent="agent-1", tokens=x)
        (state,) = decision.limits
        if used + x <= limit:
            buckets[slot] = buckets.get(slot, 0) + x
            assert (decision.allowed, state.remaining, state.reset_ms) == (True, limit - used - x, (slot + 1) * g + w - now)
            continue
        newest = max(buckets, default=0)
        retry, freed = None, 0
        if x <= limit:  # (else it never passes; and with nothing admitted yet, x > limit)
            for b in range(max(oldest, newest - 10), newest + 1):
                freed += buckets.get(b, 0)
                if freed >= used + x - limit:
                    retry = max(1, (b + 1) * g + w - now)
                    break
        assert (decision.allowed, state.remaining, decision.retry_after_ms) == (False, limit - used, retry)
        assert state.reset_ms == ((newest + 1) * g + w - now if used else 0)


def test_rolling_window_frees_capacity_bucket_by_bucket(engine, install, clock):
    install(agent=[lim("requests", 4, "10s")])
    for _ in range(2):
        assert engine.check(org="acme", agent="agent-1").allowed
    clock.advance(5000)
    for _ in range(2):
        assert engine.check(org="acme", agent="agent-1").allowed
    assert not engine.check(org="acme", agent="agent-1").allowed
    clock.advance(6000)  # the first two have left the window (and their bucket)
    assert remaining(engine.peek(org="acme", agent="agent-1"), "requests") == 2


def test_burst_is_a_token_bucket(engine, install, clock):
    """50 credits per 10 s on average, up to 50 at once; then one credit every 200 ms."""
    install(agent=[lim("credits", 50, "10s", burst=50)])
    assert sum(engine.check(org="acme", agent="agent-1", tool="web_search").allowed for _ in range(60)) == 50
    refused = engine.check(org="acme", agent="agent-1", tool="web_search")
    assert refused.retry_after_ms == 200
    clock.advance(199)
    assert not engine.check(org="acme", agent="agent-1").allowed
    clock.advance(1)
    assert engine.check(org="acme", agent="agent-1").allowed
    clock.advance(10_000)  # refilled, but never beyond the burst
    assert sum(engine.check(org="acme", agent="agent-1").allowed for _ in range(60)) == 50


def test_a_burst_smaller_than_the_limit_caps_what_passes_at_once(engine, install, clock):
    install(agent=[lim("requests", 100, "1m", burst=5)])
    assert sum(engine.check(org="acme", agent="agent-1").allowed for _ in range(10)) == 5


def ms(*args) -> int:
    return int(dt.datetime(*args, tzinfo=dt.timezone.utc).timestamp() * 1000)


def test_daily_budget_resets_at_midnight_utc(engine, install, clock):
    install(org=[lim("tokens", 1000, period="day")])
    clock.ms = ms(2026, 11, 21, 23, 59, 59) + 999
    assert engine.check(org="acme", agent="agent-1", tokens=1000).allowed
    refused = engine.check(org="acme", agent="agent-1", tokens=1)
    assert not refused.allowed and refused.retry_after_ms == 1
    assert refused.blocked_by.window == "day"
    clock.advance(1)
    decision = engine.check(org="acme", agent="agent-1", tokens=1000)
    assert decision.allowed and decision.limits[0].reset_ms == 86_400_000


def test_monthly_budget_resets_on_the_first_including_leap_years(engine, install, clock):
    install(org=[lim("requests", 1, period="month")])
    for month_end, next_month in [
        (ms(2028, 2, 29, 12), ms(2028, 3, 1)),  # leap year
        (ms(2026, 12, 31, 23, 59), ms(2027, 1, 1)),
        (ms(2027, 2, 28, 1), ms(2027, 3, 1)),
    ]:
        clock.ms = month_end
        assert engine.check(org="acme", agent="agent-1").allowed
        refused = engine.check(org="acme", agent="agent-1")
        assert not refused.allowed and refused.retry_after_ms == next_month - month_end
        clock.ms = next_month
        assert engine.check(org="acme", agent="agent-1").allowed
