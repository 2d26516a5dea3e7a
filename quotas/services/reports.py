"""Reports over the rollups: spend per day, grouped by a dimension."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal

from django.db import connection

from quotas.models import DailySpend, HourlySpend, RolledDay
from quotas.models.spend import MEASURES
from quotas.services.rollups import day_bounds

GROUPS = ("team", "user", "agent", "model", "tool")


@dataclass(frozen=True)
class SpendRow:
    day: date
    group: str  # the team, user, agent, model or tool ("" for calls with no tool or model)
    requests: int
    credits: int
    tokens: int
    input_tokens: int
    output_tokens: int
    cost: Decimal
    unsettled: int
    denied: int

    def as_dict(self, group_by: str) -> dict:
        row = {"day": self.day.isoformat(), group_by: self.group, **{m: getattr(self, m) for m in MEASURES}}
        row["cost"] = money_text(self.cost)  # a string: exact, where a JSON number is a float
        return row


def daily_spend(*, org: str | None = None, orgs: list[str] | None = None, start: date, end: date,
                group_by: str) -> list[SpendRow]:
    """Per day from ``start`` to ``end`` (inclusive, UTC) and per ``group_by`` value, in that order.

    Of ``org``, or summed over ``orgs`` (the dashboard's staff view).
    """
    if (org is None) == (orgs is None):
        raise TypeError("give org or orgs")
    if group_by not in GROUPS:
        raise ValueError(f"group_by must be one of {', '.join(GROUPS)}")
    q = connection.ops.quote_name
    column = q(HourlySpend._meta.get_field(group_by).column)
    measures = [q(HourlySpend._meta.get_field(name).column) for name in MEASURES]
    sums = ", ".join(f"SUM({m})" for m in measures)
    listed = ", ".join(measures)
    first, _ = day_bounds(start)
    _, last = day_bounds(end)
    org_list = orgs if orgs is not None else [org]
    # The rolled-up days as a list (at most 367): a day is read from exactly one of the two tables.
    rolled = list(RolledDay.objects.filter(day__range=(start, end)).values_list("day", flat=True))
    sql = f"""
        SELECT day, grp, {sums} FROM (
            SELECT day, {column} AS grp, {listed} FROM {DailySpend._meta.db_table}
             WHERE org = ANY(%(orgs)s) AND day = ANY(%(rolled)s::date[])
            UNION ALL
            SELECT (hour AT TIME ZONE 'UTC')::date, {column}, {listed} FROM {HourlySpend._meta.db_table}
             WHERE org = ANY(%(orgs)s) AND hour >= %(first)s AND hour < %(last)s
               AND NOT (hour AT TIME ZONE 'UTC')::date = ANY(%(rolled)s::date[])
        ) AS spend
        GROUP BY day, grp ORDER BY day, grp
    """
    with connection.cursor() as cur:
        cur.execute(sql, {"first": first, "last": last, "orgs": org_list, "rolled": rolled})
        return [SpendRow(row[0], row[1], *[int(v) for v in row[2:7]], Decimal(row[7]), int(row[8]), int(row[9]))
                for row in cur.fetchall()]


def days_in(start: date, end: date) -> list[date]:
    return [start + timedelta(days=n) for n in range((end - start).days + 1)]


def as_csv(rows: list[SpendRow], group_by: str) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["day", group_by, *MEASURES])
    for row in rows:
        writer.writerow([row.day.isoformat(), row.group, *[_text(getattr(row, m)) for m in MEASURES]])
    return out.getvalue()


def money_text(value: Decimal) -> str:
    """Decimal("1.230000000") -> "1.23"; never an exponent."""
    text = format(value, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _text(value) -> str:
    return money_text(value) if isinstance(value, Decimal) else str(value)
