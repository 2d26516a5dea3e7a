"""The spend pipeline: usage streams -> hourly rollups -> daily rollups, exact and idempotent.

Real engine, real Valkey, real Postgres. Checks run on a fixed clock (the engine's `clock`), so the
events land in known hours and days.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import subprocess
import sys
import threading
from decimal import Decimal
from io import StringIO
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.db.models import Sum

from quotas.engine import QuotaEngine
from quotas.engine.usage import add_to_rollups
from quotas.models import DailySpend, HourlySpend, RolledDay, StreamCursor
from quotas.policy.document import parse_policy
from quotas.services import usage_drain
from quotas.services.engine import get_engine
from quotas.services.policy_load import policy_load
from quotas.services.reports import daily_spend
from quotas.services.rollups import due_days, roll_up_due_days
from quotas.services.usage_drain import GROUP, drain_all
from tests.support import clean_redis

REPO = Path(__file__).resolve().parent.parent
ORG = "spendco"
POLICY = {
    "tool_costs": {"search": 1, "llm_call": 3},
    "model_prices": {
        "model-a": {"input": "0.0025", "output": "0.01"},
        "model-b": {"input": "0.00015", "output": "0.0006"},
        "model-c": {"input": "0.003", "output": "0.015"},
    },
    "orgs": [{
        "id": ORG,
        "limits": [{"metric": "cost", "limit": 100000, "period": "day"}],
        "teams": [
            {"id": "core", "users": [{"id": "ann", "agents": [{"id": "a1"}, {"id": "a2"}]}]},
            {"id": "labs", "users": [{"id": "ben", "agents": [
                # a tight limit, so some checks are refused
                {"id": "b1", "limits": [{"metric": "requests", "limit": 40, "window": "1h"}]},
            ]}]},
        ],
    }],
}
AGENTS = ("a1", "a2", "b1")
T0 = int(dt.datetime(2026, 3, 9, 22, 30, tzinfo=dt.UTC).timestamp() * 1000)  # a Monday, 22:30 UTC
HOUR = 3_600_000


class Clock:
    def __init__(self, ms: int):
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


@pytest.fixture
def spendco():
    clean_redis()
    with transaction.atomic():
        policy_load(doc=parse_policy(POLICY))
    engine = get_engine()
    clock = Clock(T0)
    return QuotaEngine(engine.client, key_prefix=engine.keys.prefix, clock=clock, sweep_per_check=0,
                       reservation_ttl_s=600), clock


class Sent:
    """What the test sent and the engine answered: the totals the rollups must equal."""

    def __init__(self):
        self.requests = self.denied = self.unsettled = self.input = self.output = self.credits = 0
        self.cost = Decimal(0)
        self.by_agent: dict[str, Decimal] = {agent: Decimal(0) for agent in AGENTS}


def run_traffic(engine: QuotaEngine, clock: Clock, sent: Sent, *, n: int, seed: int, step_ms: int = 7000) -> None:
    """n checks from random agents, tools and models; two in three settled, the rest left to expire."""
    rng = random.Random(seed)
    open_reservations = []
    for _ in range(n):
        clock.ms += rng.randrange(step_ms)
        agent, tool, model = rng.choice(AGENTS), rng.choice(["search", "llm_call"]), rng.choice(["model-a", "model-b", "model-c"])
        decision = engine.check(org=ORG, agent=agent, tool=tool, model=model, tokens=rng.randrange(0, 5000))
        if not decision.allowed:
            sent.denied += 1
            continue
        sent.requests += 1
        sent.credits += 1 if tool == "search" else 3
        if rng.random() < 2 / 3:
            inp, out = rng.randrange(0, 4000), rng.randrange(0, 4000)
            settled = engine.settle(org=ORG, reservation=decision.reservation, input_tokens=inp, output_tokens=out)
            assert settled.status == "settled"
            sent.input += inp
            sent.output += out
            sent.cost += settled.cost
            sent.by_agent[agent] += settled.cost
        else:
            open_reservations.append((agent, decision.reservation))
    clock.ms += 601_000  # past the reservation TTL: the rest expire at their estimate
    engine.sweep(org=ORG, batch=10_000)
    for agent, reservation in open_reservations:
        expired = engine.settle(org=ORG, reservation=reservation, input_tokens=1, output_tokens=1)
        assert expired.status == "expired"  # a late report changes nothing: it counts at its estimate
        sent.unsettled += 1
        sent.cost += expired.estimated_cost
        sent.by_agent[agent] += expired.estimated_cost


def totals(model=HourlySpend, **filters) -> dict:
    fields = ("requests", "credits", "input_tokens", "output_tokens", "cost", "unsettled", "denied")
    sums = model.objects.filter(org=ORG, **filters).aggregate(**{f: Sum(f) for f in fields})
    return {f: sums[f] or 0 for f in fields}


def expected(sent: Sent) -> dict:
    return {"requests": sent.requests, "credits": sent.credits, "input_tokens": sent.input,
            "output_tokens": sent.output, "cost": sent.cost, "unsettled": sent.unsettled, "denied": sent.denied}


def stream_state(engine: QuotaEngine) -> tuple[int, int]:
    """(entries in the stream, entries pending in the group)."""
    stream = engine.keys.usage_stream(ORG)
    groups = {group["name"]: group for group in engine.client.xinfo_groups(stream)}
    return engine.client.xlen(stream), groups[GROUP]["pending"] if GROUP in groups else 0


# -- the event arithmetic -----------------------------------------------------------------------


def test_each_kind_of_event_adds_what_the_budgets_counted():
    totals_: dict = {}
    ts = "1773095400000"  # 2026-03-09 22:30 UTC
    key = ("o", 1773093600000, "t", "u", "a", "llm_call", "m")
    add_to_rollups(totals_, f"check|o|t|u|a|llm_call|m|1|3|2000|0|0|20000000|0|0|{ts}|r1|0")
    assert totals_[key] == [1, 3, 2000, 0, 0, 20_000_000, 0, 0]
    add_to_rollups(totals_, f"settle|o|t|u|a|llm_call|m|0|0|1500|1000|500|7500000|2000|20000000|{ts}|r1|0")
    assert totals_[key] == [1, 3, 1500, 1000, 500, 7_500_000, 0, 0]  # the estimate replaced by the actual
    add_to_rollups(totals_, f"check|o|t|u|a|llm_call|m|1|3|100|0|0|900|0|0|{ts}|r2|0")
    add_to_rollups(totals_, f"expire|o|t|u|a|llm_call|m|0|0|100|0|0|900|100|900|{ts}|r2|1")
    assert totals_[key] == [2, 6, 1600, 1000, 500, 7_500_900, 1, 0]  # expired: at its estimate, one unsettled
    add_to_rollups(totals_, f"deny|o|t|u|a|llm_call|m|0|0|0|0|0|0|0|0|{ts}||0")
    assert totals_[key] == [2, 6, 1600, 1000, 500, 7_500_900, 1, 1]
    with pytest.raises(ValueError, match="not a usage event"):
        add_to_rollups(totals_, "hello|world")


# -- exact totals -------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_postgres_sums_equal_what_was_sent_decimal_exact(spendco):
    engine, clock = spendco
    sent = Sent()
    run_traffic(engine, clock, sent, n=400, seed=1)
    assert sent.denied > 0 and sent.unsettled > 0 and sent.requests > 200  # the test covers every kind

    result = drain_all(batch=97)  # several batches, not aligned with anything
    assert result.events == engine.client.xinfo_stream(engine.keys.usage_stream(ORG))["entries-added"]
    assert result.batches > 5 and result.repeats == 0
    assert totals() == expected(sent)
    for agent in AGENTS:
        cost = HourlySpend.objects.filter(org=ORG, agent=agent).aggregate(c=Sum("cost"))["c"]
        assert cost == sent.by_agent[agent]  # exact per agent too, not only in total
    # A second drain finds nothing new and counts nothing twice.
    assert drain_all().events == 0
    assert totals() == expected(sent)


@pytest.mark.django_db(transaction=True)
def test_events_land_in_their_hour_and_day(spendco):
    engine, clock = spendco
    for hour in range(4):  # 22:30, 23:30, 00:30 (next day), 01:30
        clock.ms = T0 + hour * HOUR
        assert engine.check(org=ORG, agent="a1", tool="search").allowed
    drain_all()
    hours = sorted(HourlySpend.objects.filter(org=ORG).values_list("hour", "requests"))
    assert [(h.isoformat(), r) for h, r in hours] == [
        ("2026-03-09T22:00:00+00:00", 1), ("2026-03-09T23:00:00+00:00", 1),
        ("2026-03-10T00:00:00+00:00", 1), ("2026-03-10T01:00:00+00:00", 1),
    ]


# -- failures -----------------------------------------------------------------------------------


def subprocess_env() -> dict:
    db = connection.settings_dict
    url = f"postgres://{db['USER']}:{db['PASSWORD'] or ''}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    return {**os.environ, "DATABASE_URL": url, "REDIS_URL": settings.REDIS_URL,
            "QUOTAS_REDIS_KEY_PREFIX": settings.QUOTAS_REDIS_KEY_PREFIX, "DJANGO_SETTINGS_MODULE": "project.settings"}


KILLED_AFTER_COMMIT = """
import os, signal, django
django.setup()
from quotas.services import usage_drain
write = usage_drain._write_batch
def write_then_die(*args, **kwargs):
    write(*args, **kwargs)               # committed...
    os.kill(os.getpid(), signal.SIGKILL)  # ...and killed before the XACK
usage_drain._write_batch = write_then_die
usage_drain.drain_all(batch=50)
"""


@pytest.mark.django_db(transaction=True)
def test_a_drain_killed_between_commit_and_ack_double_counts_nothing(spendco):
    engine, clock = spendco
    sent = Sent()
    run_traffic(engine, clock, sent, n=150, seed=2)
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_COMMIT], cwd=REPO, env=subprocess_env(),
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    assert HourlySpend.objects.filter(org=ORG).exists()  # its first batch was committed...
    assert stream_state(engine)[1] == 50  # ...and is still pending: it was never acknowledged

    result = drain_all(batch=50)
    assert result.repeats == 50  # reclaimed, recognised as counted, acknowledged
    assert totals() == expected(sent)
    assert stream_state(engine) == (1, 0)  # all acknowledged, and trimmed to the last entry


@pytest.mark.django_db(transaction=True)
def test_a_postgres_outage_during_a_drain_loses_nothing(spendco, monkeypatch):
    engine, clock = spendco
    sent = Sent()
    run_traffic(engine, clock, sent, n=120, seed=3)
    write = usage_drain._write_batch
    db = connection.settings_dict

    def outage_then_write(*args, **kwargs):
        # The server ends this session, as a restart or a failover would, between the read and the write.
        with psycopg.connect(host=db["HOST"], port=db["PORT"], user=db["USER"], password=db["PASSWORD"] or None,
                             dbname=db["NAME"], autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s)", [connection.connection.info.backend_pid])
        return write(*args, **kwargs)

    monkeypatch.setattr(usage_drain, "_write_batch", outage_then_write)
    with pytest.raises(CommandError, match="stays pending"):
        call_command("drain_usage", "--batch", "40", stdout=StringIO())
    monkeypatch.setattr(usage_drain, "_write_batch", write)

    assert not HourlySpend.objects.filter(org=ORG).exists()
    entries, pending = stream_state(engine)
    assert pending == 40 and entries > 40  # read, not written: pending, nothing trimmed
    out = StringIO()
    call_command("drain_usage", stdout=out)
    assert "drained" in out.getvalue()
    assert totals() == expected(sent)
    assert stream_state(engine) == (1, 0)


@pytest.mark.django_db(transaction=True)
def test_drains_running_at_once_count_everything_once(spendco):
    engine, clock = spendco
    sent = Sent()
    errors = []
    done = threading.Event()

    def drainer():
        try:
            while not done.is_set():
                drain_all(batch=13)
            drain_all(batch=13)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=drainer) for _ in range(3)]
    for thread in threads:
        thread.start()
    run_traffic(engine, clock, sent, n=200, seed=4)
    done.set()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    drain_all()
    assert totals() == expected(sent)
    assert StreamCursor.objects.get(stream=engine.keys.usage_stream(ORG)).events == \
        engine.client.xinfo_stream(engine.keys.usage_stream(ORG))["entries-added"]


@pytest.mark.django_db(transaction=True)
def test_the_stream_is_trimmed_once_drained(spendco):
    engine, clock = spendco
    for _ in range(300):
        clock.ms += 1000
        engine.check(org=ORG, agent="a1", tool="search")
    assert stream_state(engine) == (300, 0)
    drain_all(batch=100)
    assert stream_state(engine) == (1, 0)  # the newest entry stays: XTRIM MINID keeps the cursor's entry


@pytest.mark.django_db(transaction=True)
def test_the_drain_marks_which_agents_spent_for_the_budget_alerts(spendco):
    engine, clock = spendco
    engine.check(org=ORG, agent="a1", tool="search")
    while engine.check(org=ORG, agent="b1", tool="search").allowed:  # b1 spends up to its limit, then is refused
        pass
    drain_all()
    assert engine.client.smembers(engine.keys.spent_agents(ORG)) == {"a1", "b1"}


# -- daily rollups and the report ---------------------------------------------------------------


def report_total(group_by="team") -> dict:
    rows = daily_spend(org=ORG, start=dt.date(2026, 3, 1), end=dt.date(2026, 3, 31), group_by=group_by)
    return {(row.day.isoformat(), row.group): (row.requests, row.cost) for row in rows}


@pytest.mark.django_db(transaction=True)
def test_daily_rollups_equal_the_hours_and_a_late_event_reopens_its_day(spendco):
    engine, clock = spendco
    sent = Sent()
    run_traffic(engine, clock, sent, n=200, seed=5, step_ms=120_000)  # about 3 h: across midnight
    drain_all()
    from_hours = report_total()
    days = {day for day, _ in from_hours}
    assert days == {"2026-03-09", "2026-03-10"}

    assert due_days(now=dt.datetime(2026, 3, 12, tzinfo=dt.UTC)) == [dt.date(2026, 3, 9), dt.date(2026, 3, 10)]
    roll_up_due_days(now=dt.datetime(2026, 3, 12, tzinfo=dt.UTC))
    assert set(RolledDay.objects.values_list("day", flat=True)) == {dt.date(2026, 3, 9), dt.date(2026, 3, 10)}
    assert totals(DailySpend) == totals(HourlySpend) == expected(sent)
    assert report_total() == from_hours  # now read from the daily rows: the same answer

    # A late event for the 9th (a drain that was down over midnight): the day is read from its hours again.
    clock.ms = T0 + 10 * 60_000
    assert engine.check(org=ORG, agent="a1", tool="search").allowed
    drain_all()
    assert set(RolledDay.objects.values_list("day", flat=True)) == {dt.date(2026, 3, 10)}
    reopened = report_total()
    assert reopened[("2026-03-09", "core")][0] == from_hours[("2026-03-09", "core")][0] + 1
    roll_up_due_days(now=dt.datetime(2026, 3, 12, tzinfo=dt.UTC))
    assert report_total() == reopened
    assert totals(DailySpend) == totals(HourlySpend)


@pytest.mark.django_db(transaction=True)
def test_roll_up_days_command(spendco):
    engine, clock = spendco
    engine.check(org=ORG, agent="a1", tool="search")
    drain_all()
    out = StringIO()
    call_command("roll_up_days", "--from", "2026-03-09", "--to", "2026-03-09", stdout=out)
    assert "2026-03-09: 1 rows" in out.getvalue()
    with pytest.raises(CommandError, match="not a date"):
        call_command("roll_up_days", "--from", "yesterday")
    with pytest.raises(CommandError, match="not over yet"):
        call_command("roll_up_days", "--from", "2026-03-09", "--to", "2999-01-01")


@pytest.mark.django_db(transaction=True)
def test_entries_written_by_something_else_are_stored_exactly_or_skipped(spendco, caplog):
    engine, clock = spendco
    stream = engine.keys.usage_stream(ORG)
    odd_tool = "tab\there back\\slash"  # not an id the service allows, but COPY must not trip on it
    engine.client.xadd(stream, {"e": f"check|{ORG}|core|ann|a1|{odd_tool}||1|1|0|0|0|5|0|0|{T0}|r9|0"})
    engine.client.xadd(stream, {"e": "not|an|event"})
    engine.client.xadd(stream, {"other": "field"})
    engine.check(org=ORG, agent="a1", tool="search")
    result = drain_all()
    assert result.events == 4  # all acknowledged: a bad entry must not block the stream
    assert HourlySpend.objects.get(org=ORG, tool=odd_tool).cost == Decimal("0.000000005")
    assert HourlySpend.objects.get(org=ORG, tool="search").requests == 1
    assert sum("no usage event" in message for message in caplog.messages) == 2
    assert stream_state(engine) == (1, 0)


@pytest.mark.django_db(transaction=True)
def test_a_drain_inside_a_callers_transaction_is_refused(spendco):
    engine, clock = spendco
    engine.check(org=ORG, agent="a1", tool="search")
    with pytest.raises(RuntimeError, match="durable"), transaction.atomic():
        drain_all()  # its XACKs would outlive a rollback of the caller's transaction
    assert stream_state(engine) == (1, 1)  # read, not acknowledged: the next drain counts it
    drain_all()
    assert totals()["requests"] == 1


@pytest.mark.django_db(transaction=True)
def test_a_batch_waits_while_an_older_entry_is_pending_elsewhere(spendco):
    """A drain whose lock went with its connection read entries; the drain that took over must not
    move the cursor past them, or they would later look counted."""
    engine, clock = spendco
    sent = Sent()
    run_traffic(engine, clock, sent, n=40, seed=7)
    stream = engine.keys.usage_stream(ORG)
    engine.client.xgroup_create(stream, GROUP, id="0")
    lost = engine.client.xreadgroup(GROUP, "lost-drain", {stream: ">"}, count=10)[0][1]  # read, never applied
    assert len(lost) == 10
    # The new drain reclaims them first (XAUTOCLAIM) and applies all in order: nothing lost.
    assert drain_all(batch=10).events == engine.client.xinfo_stream(stream)["entries-added"]
    assert totals() == expected(sent)


@pytest.mark.django_db(transaction=True)
def test_new_entries_are_not_applied_past_an_entry_another_drain_holds(spendco, monkeypatch):
    engine, clock = spendco
    stream = engine.keys.usage_stream(ORG)
    for _ in range(30):
        clock.ms += 1000
        engine.check(org=ORG, agent="a1", tool="search")
    engine.client.xgroup_create(stream, GROUP, id="0")
    drain = usage_drain._StreamDrain(engine.client, stream, engine.keys.spent_agents(ORG), batch=10)
    monkeypatch.setattr(drain, "_forget_idle_consumers", lambda: None)
    StreamCursor.objects.get_or_create(stream=stream)
    drain.last = (0, 0)
    # A drain that lost its lock reads entries 1-10 after this one's reclaim pass and before its read.
    engine.client.xreadgroup(GROUP, "lost-drain", {stream: ">"}, count=10)
    entries = engine.client.xreadgroup(GROUP, drain.consumer, {stream: ">"}, count=10)[0][1]
    with pytest.raises(usage_drain.DrainConflict, match="lost-drain"):
        drain._apply(entries, new=True)
    assert not HourlySpend.objects.exists()  # nothing applied past the held entries
    result = drain_all()  # the next drain takes both, in order
    assert result.events == 30 and totals()["requests"] == 30


@pytest.mark.django_db(transaction=True)
def test_one_orgs_failure_does_not_hold_up_the_others(spendco):
    engine, clock = spendco
    engine.check(org=ORG, agent="a1", tool="search")
    broken = engine.keys.usage_stream("aaa-broken")  # sorts before spendco
    engine.client.set(broken, "not a stream")
    engine.client.sadd(engine.keys.org_index(), "aaa-broken")
    try:
        result = drain_all()
        assert totals()["requests"] == 1
        assert list(result.failed) == [broken] and "WRONGTYPE" in result.failed[broken]
        with pytest.raises(CommandError, match="1 streams failed"):
            call_command("drain_usage", stdout=StringIO())
    finally:
        engine.client.delete(broken)
        engine.client.srem(engine.keys.org_index(), "aaa-broken")


def test_an_event_is_counted_whole_or_not_at_all():
    totals_: dict = {}
    ts = "1773095400000"
    with pytest.raises(ValueError, match="out of range"):
        add_to_rollups(totals_, f"check|o|t|u|a|x|m|1|3|{2**60}|0|0|0|0|0|{ts}|r1|0")
    with pytest.raises(ValueError, match="out of range"):
        add_to_rollups(totals_, "check|o|t|u|a|x|m|1|3|0|0|0|0|0|0|99999999999999999|r1|0")
    with pytest.raises(ValueError, match="too long"):
        add_to_rollups(totals_, f"check|o|t|u|{'a' * 65}|x|m|1|3|0|0|0|0|0|0|{ts}|r1|0")
    with pytest.raises(ValueError):
        add_to_rollups(totals_, f"check|o|t|u|a|x|m|1|3|0|0|0|zero|0|0|{ts}|r1|0")
    assert totals_ == {}


@pytest.mark.django_db(transaction=True)
def test_a_reclaimed_batch_of_counted_and_uncounted_entries_counts_each_once(spendco):
    """Pending: 10 entries a killed drain committed (not acknowledged), then 10 a failed write left.
    The next drain reclaims all 20 in one batch: the first 10 are repeats, the rest count."""
    engine, clock = spendco
    stream = engine.keys.usage_stream(ORG)
    for _ in range(20):
        clock.ms += 1000
        engine.check(org=ORG, agent="a1", tool="search")
    engine.client.xgroup_create(stream, GROUP, id="0")
    committed = engine.client.xreadgroup(GROUP, "killed-drain", {stream: ">"}, count=10)[0][1]
    engine.client.xreadgroup(GROUP, "failed-drain", {stream: ">"}, count=10)
    StreamCursor.objects.get_or_create(stream=stream)
    counted: dict = {}
    for _, fields in committed:
        add_to_rollups(counted, fields["e"])
    newest = usage_drain._parse_id(committed[-1][0])
    usage_drain._write_batch(stream, (0, 0), newest, len(committed), counted)  # committed, never acknowledged
    assert totals()["requests"] == 10
    result = drain_all(batch=100)  # reclaims all 20 pending entries in one batch
    assert (result.events, result.repeats) == (10, 10)
    assert totals()["requests"] == 20
    assert stream_state(engine) == (1, 0)
