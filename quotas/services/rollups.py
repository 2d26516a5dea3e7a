"""Daily rollups: a finished UTC day's hourly rows summed into one row per node, tool and model.

Reports read a rolled-up day from DailySpend and any other day (today, or a day a late event
reopened) from HourlySpend, so they always equal the hourly rows. A day's rollup and a drain that
adds to that day take the same advisory lock: the rollup sees all of a batch or none of it, and the
batch's drain removes the day's mark after the rollup made it.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

from django.db import connection, transaction
from django.utils import timezone

from quotas.models import DailySpend, HourlySpend, RolledDay
from quotas.models.spend import DIMENSIONS, MEASURES, columns
from quotas.services.usage_drain import DAY_LOCK

# Finished days the scheduled rollup looks back over (older days: `manage.py roll_up_days --from`).
LOOKBACK_DAYS = 35


def day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, time.min, tzinfo=UTC)
    return start, start + timedelta(days=1)


def today_utc(now: datetime | None = None) -> date:
    return (now or timezone.now()).astimezone(UTC).date()


def roll_up_day(day: date, *, now: datetime | None = None) -> int:
    """Replace ``day``'s daily rows with the sums of its hourly rows; returns the rows written.

    Only a finished day (before today, UTC) is marked rolled up: today's hours still grow.
    """
    if day >= today_utc(now):
        raise ValueError(f"{day} is not over yet (UTC); only finished days are rolled up")
    start, end = day_bounds(day)
    daily, hourly = DailySpend._meta.db_table, HourlySpend._meta.db_table
    dims = ", ".join(columns(DIMENSIONS))
    measures = columns(MEASURES)
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", [DAY_LOCK, day.toordinal()])
        cur.execute(f"DELETE FROM {daily} WHERE day = %s", [day])
        cur.execute(
            f"INSERT INTO {daily} (org, day, {dims}, {', '.join(measures)}) "
            f"SELECT org, %s, {dims}, {', '.join(f'SUM({m})' for m in measures)} FROM {hourly} "
            f"WHERE hour >= %s AND hour < %s GROUP BY org, {dims}",
            [day, start, end],
        )
        written = cur.rowcount
        RolledDay.objects.update_or_create(day=day)
    return written


def due_days(*, now: datetime | None = None, lookback: int = LOOKBACK_DAYS) -> list[date]:
    """Finished days of the last ``lookback`` with hourly rows and no (valid) rollup."""
    today = today_utc(now)
    candidates = [today - timedelta(days=n) for n in range(lookback, 0, -1)]
    rolled = set(RolledDay.objects.filter(day__gte=candidates[0]).values_list("day", flat=True))
    due = []
    for day in candidates:
        if day not in rolled:
            start, end = day_bounds(day)
            if HourlySpend.objects.filter(hour__gte=start, hour__lt=end).exists():
                due.append(day)
    return due


def roll_up_due_days(*, now: datetime | None = None) -> list[date]:
    """The scheduled rollup: every due day, oldest first."""
    days = due_days(now=now)
    for day in days:
        roll_up_day(day, now=now)
    return days
