"""Reports over the rollups: spend per day, grouped by a dimension."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal

from django.db import connection

from quotas.models import DailySpend, HourlySpend, RolledDay
from quotas.models.spend import MEASURES, column, columns
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
    group = column(group_by)
    sums = ", ".join(f"SUM({m})" for m in columns(MEASURES))
    sql = f"SELECT day, {group}, {sums} FROM {spend_in_range([group])} GROUP BY day, {group} ORDER BY day, {group}"
    with connection.cursor() as cur:
        cur.execute(sql, spend_params(orgs if orgs is not None else [org], start, end))
        return [SpendRow(row[0], row[1], *[int(v) for v in row[2:7]], Decimal(row[7]), int(row[8]), int(row[9]))
                for row in cur.fetchall()]


def spend_in_range(picked_columns: list[str]) -> str:
    """SQL for FROM: the rollup rows of %(orgs)s from %(start)s to %(end)s (with spend_params), as
    ``spend(day, *picked_columns, *measures)``; each day read from exactly one table: DailySpend when it is
    rolled up, HourlySpend otherwise. One statement, so one snapshot: a late event drained meanwhile
    is in both or in neither of what it reads."""
    # An array, evaluated once (a semi-join on the marks can be planned as a loop per row).
    rolled = f"ARRAY(SELECT day FROM {RolledDay._meta.db_table} WHERE day BETWEEN %(start)s AND %(end)s)"
    picked = ", ".join([*picked_columns, *columns(MEASURES)])
    return f"""(
        SELECT day, {picked} FROM {DailySpend._meta.db_table}
         WHERE org = ANY(%(orgs)s) AND day = ANY({rolled})
        UNION ALL
        SELECT (hour AT TIME ZONE 'UTC')::date, {picked} FROM {HourlySpend._meta.db_table}
         WHERE org = ANY(%(orgs)s) AND hour >= %(first)s AND hour < %(last)s
           AND NOT (hour AT TIME ZONE 'UTC')::date = ANY({rolled})
    ) AS spend"""


def spend_params(orgs: list[str], start: date, end: date) -> dict:
    first, _ = day_bounds(start)
    _, last = day_bounds(end)
    return {"orgs": orgs, "start": start, "end": end, "first": first, "last": last}


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
