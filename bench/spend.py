"""Issue 5's benchmark: the spend pipeline's drain throughput and the daily report over 1,000,000 events.

On the PostgreSQL (durable: fsync on) and Valkey that `make bench` starts, after `manage.py migrate`:

1. Writes 1,000,000 usage events into one org's stream (pipelined XADD), spread over the last 30
   days in stream order, as the scripts write them: calls of 1,000 agents (100 users, 10 teams),
   6 tools and 4 models; each call a `check`, then a `settle` (80%) or an `expire` (10%), and 10%
   of calls refused (`deny`).
2. (a) baseline: the same entries read through a consumer group, parsed and acknowledged, with no
   database: the ceiling of any drain on this Redis client.
   (b) `drain_all()`: the real drain into the hourly rollups (one transaction per batch of
   QUOTAS_DRAIN_BATCH entries). Both in events/s; target: (b) >= 20,000.
3. Rolls the 30 days up (`roll_up_day`) and ANALYZEs the tables (as autovacuum would within a
   minute of such a load), then times `daily_spend()` over the 30 days for each
   grouping, (c) from the daily rollups (every day rolled up, the normal case) and (d) from the
   hourly rows (no day rolled up: the worst case). Target: < 2 s.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import time

from bench.common import table

EVENTS = int(os.environ.get("AQ_BENCH_SPEND_EVENTS", 1_000_000))
DAYS = 30
ORG = "bench-spend"
TOOLS = ("web_search", "read_page", "llm_call", "code_execute", "image_generate", "send_email")
MODELS = ("gpt-4o", "gpt-4o-mini", "claude-sonnet-4", "")
GROUPS = ("team", "user", "agent", "model", "tool")
TARGET_EVENTS_S = 20_000
TARGET_REPORT_S = 2.0


def _django():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("DEBUG", "true")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _events(n: int, *, end_ms: int, seed: int = 5):
    """n event lines in time order over DAYS days up to end_ms, as lua/lib.lua's usage_event writes them."""
    rng = random.Random(seed)
    agents = [(f"team-{a % 10}", f"user-{a % 100}", f"agent-{a}") for a in range(1000)]
    step = DAYS * 86_400_000 / n
    made, call = 0, 0
    while made < n:
        ts = int(end_ms - DAYS * 86_400_000 + made * step)
        team, user, agent = rng.choice(agents)
        tool, model = rng.choice(TOOLS), rng.choice(MODELS)
        path = f"{ORG}|{team}|{user}|{agent}|{tool}|{model}"
        call += 1
        if rng.random() < 0.1:
            lines = [f"deny|{path}|0|0|0|0|0|0|0|0|{ts}||0"]
        else:
            rid = f"r{call}"
            est, est_cost = rng.randrange(0, 4000), rng.randrange(0, 40_000_000)
            lines = [f"check|{path}|1|3|{est}|0|0|{est_cost}|0|0|{ts}|{rid}|0"]
            fate = rng.random()
            if fate < 0.8 / 0.9:
                inp, out = rng.randrange(0, 3000), rng.randrange(0, 1500)
                lines.append(f"settle|{path}|0|0|{inp + out}|{inp}|{out}|{rng.randrange(0, 40_000_000)}|{est}|"
                             f"{est_cost}|{ts}|{rid}|0")
            else:
                lines.append(f"expire|{path}|0|0|{est}|0|0|{est_cost}|{est}|{est_cost}|{ts}|{rid}|1")
        for line in lines[: n - made]:
            yield line
            made += 1


def _fill(client, stream: str, n: int, end_ms: int) -> float:
    client.delete(stream)
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i, line in enumerate(_events(n, end_ms=end_ms), 1):
        pipe.xadd(stream, {"e": line})
        if i % 10_000 == 0:
            pipe.execute()
            if i % 200_000 == 0:
                print(f"  wrote {i:,} events", flush=True)
    pipe.execute()
    return time.perf_counter() - started


def _baseline_read(client, stream: str, batch: int) -> float:
    """(a): XREADGROUP + parse + XACK, no database."""
    from quotas.engine.usage import EVENT_FIELD, add_to_rollups

    group = "bench-baseline"
    try:
        client.xgroup_destroy(stream, group)
    except Exception:
        pass
    client.xgroup_create(stream, group, id="0")
    started = time.perf_counter()
    while True:
        reply = client.xreadgroup(group, "bench", {stream: ">"}, count=batch)
        entries = reply[0][1] if reply else []
        if not entries:
            break
        totals: dict = {}
        for _, fields in entries:
            add_to_rollups(totals, fields[EVENT_FIELD])
        client.xack(stream, group, *[entry_id for entry_id, _ in entries])
    elapsed = time.perf_counter() - started
    client.xgroup_destroy(stream, group)
    return elapsed


def run() -> dict:
    _django()
    from django.conf import settings
    from django.db import connection

    from quotas.models import DailySpend, HourlySpend, RolledDay, StreamCursor
    from quotas.services.reports import daily_spend
    from quotas.services.rollups import roll_up_day
    from quotas.services.engine import get_batch_redis, get_engine
    from quotas.services.usage_drain import drain_org

    engine = get_engine()
    client = get_batch_redis()
    stream = engine.keys.usage_stream(ORG)
    with connection.cursor() as cur:  # a clean slate (the bench database persists between runs)
        for model in (HourlySpend, DailySpend, RolledDay, StreamCursor):
            cur.execute(f"TRUNCATE {model._meta.db_table}")
    today = dt.datetime.now(dt.UTC).date()
    end_ms = int(dt.datetime.combine(today, dt.time.min, tzinfo=dt.UTC).timestamp() * 1000) - 1
    print(f"  writing {EVENTS:,} events over {DAYS} days into {stream}", flush=True)
    fill_s = _fill(client, stream, EVENTS, end_ms)
    batch = settings.QUOTAS_DRAIN_BATCH
    baseline_s = _baseline_read(client, stream, batch)
    print(f"  (a) read + parse + ack: {EVENTS / baseline_s:,.0f} events/s", flush=True)

    started = time.perf_counter()
    result = drain_org(ORG, progress=lambda s, r: print(f"  drained {r.events:,}", flush=True)
                       if r.batches % 40 == 0 else None)
    drain_s = time.perf_counter() - started
    assert result.events == EVENTS, result
    hourly_rows = HourlySpend.objects.count()

    first = today - dt.timedelta(days=DAYS)
    last = today - dt.timedelta(days=1)

    def report_times() -> dict:
        times = {}
        for group in GROUPS:
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                rows = daily_spend(org=ORG, start=first, end=last, group_by=group)
                runs.append(time.perf_counter() - t0)
            times[group] = (min(runs), max(runs), len(rows))
        return times

    analyze = f"ANALYZE {HourlySpend._meta.db_table}, {DailySpend._meta.db_table}"
    with connection.cursor() as cur:  # as autovacuum would within a minute of such a load
        cur.execute(analyze)
    from_hours = report_times()
    started = time.perf_counter()
    for n in range(DAYS):
        roll_up_day(first + dt.timedelta(days=n))
    rollup_s = time.perf_counter() - started
    with connection.cursor() as cur:
        cur.execute(analyze)
    from_days = report_times()
    client.delete(stream)
    return {
        "events": EVENTS, "fill_s": fill_s, "baseline_s": baseline_s, "drain_s": drain_s, "batch": batch,
        "batches": result.batches, "hourly_rows": hourly_rows, "daily_rows": DailySpend.objects.count(),
        "rollup_s": rollup_s, "from_hours": from_hours, "from_days": from_days,
    }


def report(r: dict) -> str:
    n = r["events"]
    a, b = n / r["baseline_s"], n / r["drain_s"]
    lines = [
        f"{n:,} events over {DAYS} days; batches of {r['batch']:,}; {r['hourly_rows']:,} hourly rows, "
        f"{r['daily_rows']:,} daily rows",
        "",
        table(["case", "events/s", "vs (a)"], [
            ["(a) read + parse + ack, no database", f"{a:,.0f}", "1.00x"],
            ["(b) drain into the hourly rollups", f"{b:,.0f}", f"{b / a:.2f}x"],
        ]),
        "",
        f"daily rollup of {DAYS} days: {r['rollup_s']:.2f}s",
        "",
        table(["report over 30 days, group_by", "(c) from daily rows, s", "(d) from hourly rows, s", "rows"], [
            [g, f"{r['from_days'][g][0]:.3f}-{r['from_days'][g][1]:.3f}",
             f"{r['from_hours'][g][0]:.3f}-{r['from_hours'][g][1]:.3f}", r["from_days"][g][2]]
            for g in GROUPS
        ]),
        "",
        f"target: drain >= {TARGET_EVENTS_S:,} events/s: {b:,.0f} ({'met' if b >= TARGET_EVENTS_S else 'MISSED'})",
    ]
    worst_days = max(v[1] for v in r["from_days"].values())
    worst_hours = max(v[1] for v in r["from_hours"].values())
    lines.append(f"target: report over {n:,} events < {TARGET_REPORT_S:.0f}s: worst {worst_days:.3f}s from daily rows "
                 f"({'met' if worst_days < TARGET_REPORT_S else 'MISSED'}), {worst_hours:.3f}s from hourly rows "
                 f"({'met' if worst_hours < TARGET_REPORT_S else 'MISSED'})")
    return "\n".join(lines)
