"""Reservations: the estimate is charged at check time and settled with the actual usage."""

from __future__ import annotations

from decimal import Decimal

import pytest

from quotas.engine import UnknownReservation
from quotas.engine.usage import parse_event

from .conftest import lim, remaining

GPT4O = {"gpt-4o": (Decimal("0.0025"), Decimal("0.01"))}


def test_cost_estimate_uses_the_higher_price_and_is_decimal_exact(engine, install):
    install(org=[lim("cost", "1.00", period="day")], prices={"m": (Decimal("0.00015"), Decimal("0.0006"))})
    decision = engine.check(org="acme", agent="agent-1", model="m", tokens=1234)
    # 1234 tokens at the output price: 1234 * 0.0006 / 1000 = 0.0007404
    assert remaining(decision, "cost") == Decimal("1.00") - Decimal("0.0007404")


def test_cost_is_rounded_up_to_the_nano_dollar_per_call(engine, install):
    install(org=[lim("cost", "1", period="day")], prices={"m": (Decimal("0.00000333"), Decimal("0.00000333"))})
    decision = engine.check(org="acme", agent="agent-1", model="m", tokens=1)
    assert remaining(decision, "cost") == Decimal("1") - Decimal("0.000000004")  # 3.33e-9 -> 4e-9


def test_settle_charges_actual_tokens_and_cost_and_refunds_the_difference(engine, install):
    install(org=[lim("cost", "5", period="day")], user=[lim("tokens", 10_000, "1h")],
            agent=[lim("tokens", 5000, "1h"), lim("requests", 10, "1h")], prices=GPT4O)
    decision = engine.check(org="acme", agent="agent-1", tool="llm_call", model="gpt-4o", tokens=2000)
    assert remaining(decision, "tokens", "agent") == 3000
    settled = engine.settle(org="acme", reservation=decision.reservation, input_tokens=1200, output_tokens=640)
    assert (settled.status, settled.tokens) == ("settled", 1840)
    assert settled.cost == Decimal("1200") * Decimal("0.0025") / 1000 + Decimal("640") * Decimal("0.01") / 1000
    assert settled.estimated_cost == Decimal("0.02")
    after = engine.peek(org="acme", agent="agent-1")
    assert remaining(after, "tokens", "agent") == 5000 - 1840
    assert remaining(after, "tokens", "user") == 10_000 - 1840
    assert remaining(after, "cost") == Decimal("5") - Decimal("0.0094")
    assert remaining(after, "requests") == 9  # a request is a request, whatever it used


def test_settle_can_charge_more_than_the_estimate(engine, install):
    install(agent=[lim("tokens", 5000, "1h")])
    decision = engine.check(org="acme", agent="agent-1", tokens=100)
    engine.settle(org="acme", reservation=decision.reservation, input_tokens=3000, output_tokens=1000)
    assert remaining(engine.peek(org="acme", agent="agent-1"), "tokens") == 1000


def test_settling_twice_changes_nothing(engine, install, redis_client):
    install(agent=[lim("tokens", 5000, "1h")])
    decision = engine.check(org="acme", agent="agent-1", tokens=2000)
    first = engine.settle(org="acme", reservation=decision.reservation, input_tokens=100, output_tokens=100)
    events = redis_client.xlen(engine.keys.usage_stream("acme"))
    second = engine.settle(org="acme", reservation=decision.reservation, input_tokens=999, output_tokens=999)
    assert second.status == "repeat" and (second.tokens, second.cost) == (first.tokens, first.cost)
    assert remaining(engine.peek(org="acme", agent="agent-1"), "tokens") == 4800
    assert redis_client.xlen(engine.keys.usage_stream("acme")) == events


def test_settle_refunds_token_buckets_and_calendar_periods(engine, install):
    install(org=[lim("tokens", 1000, period="month")], agent=[lim("tokens", 1000, "1m", burst=1000)])
    decision = engine.check(org="acme", agent="agent-1", tokens=900)
    engine.settle(org="acme", reservation=decision.reservation, input_tokens=50, output_tokens=50)
    after = engine.peek(org="acme", agent="agent-1")
    assert remaining(after, "tokens", "org") == 900 and remaining(after, "tokens", "agent") == 900


def test_an_unsettled_reservation_expires_and_counts_at_its_estimate(engine, install, clock, redis_client):
    install(agent=[lim("tokens", 5000, "1d")])
    decision = engine.check(org="acme", agent="agent-1", tokens=2000)
    clock.advance(engine.reservation_ttl_ms - 1)
    assert engine.sweep(org="acme") == 0
    clock.advance(1)
    assert engine.sweep(org="acme") == 1
    assert engine.sweep(org="acme") == 0  # once
    late = engine.settle(org="acme", reservation=decision.reservation, input_tokens=10, output_tokens=10)
    assert late.status == "expired" and late.estimated_tokens == 2000 and late.tokens is None
    assert remaining(engine.peek(org="acme", agent="agent-1"), "tokens") == 3000
    events = [parse_event(f) for _, f in redis_client.xrange(engine.keys.usage_stream("acme"))]
    expired = [event for event in events if event.kind == "expire"]
    assert len(expired) == 1
    assert (expired[0].tokens, expired[0].unsettled, expired[0].reservation) == (2000, True, decision.reservation)


def test_checks_sweep_a_few_overdue_reservations_on_their_way(engine, install, clock, redis_client):
    install(agent=[lim("requests", 100, "1d")])
    engine.check(org="acme", agent="agent-1")
    clock.advance(engine.reservation_ttl_ms)
    engine.sweep_per_check = 2
    engine.check(org="acme", agent="agent-1")
    kinds = [parse_event(f).kind for _, f in redis_client.xrange(engine.keys.usage_stream("acme"))]
    assert kinds == ["check", "expire", "check"]


def test_unknown_reservations_are_refused(engine, install):
    install(agent=[lim("tokens", 5000, "1h")])
    for bad in ("nope", "abc.eng.alice.agent-1", "a.b.c.d.e", ""):
        with pytest.raises(UnknownReservation):
            engine.settle(org="acme", reservation=bad, input_tokens=1, output_tokens=1)


def test_settlement_appends_a_usage_event_with_actual_and_estimate(engine, install, redis_client, clock):
    install(agent=[lim("tokens", 5000, "1h")], prices=GPT4O)
    decision = engine.check(org="acme", agent="agent-1", tool="llm_call", model="gpt-4o", tokens=2000)
    engine.settle(org="acme", reservation=decision.reservation, input_tokens=1200, output_tokens=640)
    settle = parse_event(redis_client.xrange(engine.keys.usage_stream("acme"))[-1][1])
    assert (settle.kind, settle.input_tokens, settle.output_tokens, settle.tokens) == ("settle", 1200, 640, 1840)
    assert (settle.cost, settle.est_tokens, settle.est_cost) == (Decimal("0.0094"), 2000, Decimal("0.02"))
    assert (settle.agent, settle.reservation, settle.ts_ms) == ("agent-1", decision.reservation, clock.ms)


def test_settled_records_answer_repeats_for_one_ttl_then_go(engine, install, clock, redis_client):
    install(agent=[lim("tokens", 5000, "1h")])
    decision = engine.check(org="acme", agent="agent-1", tokens=10)
    clock.advance(1000)
    engine.settle(org="acme", reservation=decision.reservation, input_tokens=5, output_tokens=5)
    clock.advance(engine.reservation_ttl_ms - 1000)  # the check's queue entry is due, the settlement's is not
    assert engine.sweep(org="acme") == 0
    assert engine.settle(org="acme", reservation=decision.reservation, input_tokens=1, output_tokens=1).status == "repeat"
    clock.advance(1000)
    engine.sweep(org="acme")
    with pytest.raises(UnknownReservation):
        engine.settle(org="acme", reservation=decision.reservation, input_tokens=1, output_tokens=1)
    assert redis_client.hlen(engine.keys.reservations("acme")) == 0
    assert redis_client.llen(engine.keys.reservation_queue("acme")) == 0
