"""Usage events: what the scripts append to each org's usage stream, and how to read them back.

One stream entry holds one event in one field, ``e``, as a line of ``|``-separated values in
the order of ``FIELDS`` (one field keeps XADD cheap on the hot path)::

    XADD aq:{acme}:usage * e "check|acme|eng|alice|agent-1|llm_call|gpt-4o|1|3|2000|0|0|20000000|0|0|1795291810434|5f0c.eng.alice.agent-1|0"

kinds: ``check`` (an admitted check: requests, credits, the estimated tokens and cost),
``deny`` (a refused check: nothing charged), ``settle`` (actual input/output tokens and cost,
with the estimate it replaces), ``expire`` (a reservation never settled: counts at its estimate,
``unsettled`` = 1). Cost is in nano-USD.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from .compile import nanos_to_usd

EVENT_FIELD = "e"
FIELDS = (
    "kind", "org", "team", "user", "agent", "tool", "model", "requests", "credits", "tokens", "input_tokens",
    "output_tokens", "cost_nanos", "est_tokens", "est_cost_nanos", "ts_ms", "reservation", "unsettled",
)
KINDS = ("check", "deny", "settle", "expire")


@dataclass(frozen=True)
class UsageEvent:
    kind: str
    org: str
    team: str
    user: str
    agent: str
    tool: str
    model: str
    requests: int
    credits: int
    tokens: int
    input_tokens: int
    output_tokens: int
    cost: Decimal  # USD
    est_tokens: int
    est_cost: Decimal
    ts_ms: int
    reservation: str
    unsettled: bool


def parse_event(fields: dict) -> UsageEvent:
    """A stream entry's fields (str or bytes keys) -> UsageEvent."""
    raw = fields.get(EVENT_FIELD, fields.get(EVENT_FIELD.encode()))
    if isinstance(raw, bytes):
        raw = raw.decode()
    values = raw.split("|")
    if len(values) != len(FIELDS) or values[0] not in KINDS:
        raise ValueError(f"not a usage event: {raw!r}")
    v = dict(zip(FIELDS, values))
    number = lambda name: int(v[name] or 0)  # noqa: E731
    return UsageEvent(
        kind=v["kind"], org=v["org"], team=v["team"], user=v["user"], agent=v["agent"], tool=v["tool"],
        model=v["model"], requests=number("requests"), credits=number("credits"), tokens=number("tokens"),
        input_tokens=number("input_tokens"), output_tokens=number("output_tokens"),
        cost=nanos_to_usd(number("cost_nanos")), est_tokens=number("est_tokens"),
        est_cost=nanos_to_usd(number("est_cost_nanos")), ts_ms=number("ts_ms"), reservation=v["reservation"],
        unsettled=v["unsettled"] == "1",
    )


# -- rollups ------------------------------------------------------------------------------------
# What an hourly rollup row adds up, in this order (quotas.models.spend.MEASURES, cost in nano-USD).
MEASURES = ("requests", "credits", "tokens", "input_tokens", "output_tokens", "cost_nanos", "unsettled", "denied")
HOUR_MS = 3_600_000


def add_to_rollups(totals: dict[tuple, list[int]], raw: str) -> None:
    """Add one event (an entry's ``e`` field) to ``totals``: (org, hour_ms, team, user, agent, tool, model) -> MEASURES.

    Tokens and cost count as the budgets count them: a check adds its estimate, a settlement the
    difference between the actual and that estimate, an expiry nothing (the estimate stays; it
    counts one unsettled reservation). So the sums equal what was charged, whatever is still open.
    """
    v = raw.split("|")
    if len(v) != len(FIELDS) or v[0] not in KINDS:
        raise ValueError(f"not a usage event: {raw!r}")
    key = (v[1], int(v[15]) // HOUR_MS * HOUR_MS, v[2], v[3], v[4], v[5], v[6])
    row = totals.get(key)
    if row is None:
        row = totals[key] = [0, 0, 0, 0, 0, 0, 0, 0]
    row[0] += int(v[7])
    row[1] += int(v[8])
    row[2] += int(v[9]) - int(v[13])
    row[3] += int(v[10])
    row[4] += int(v[11])
    row[5] += int(v[12]) - int(v[14])
    row[6] += v[17] == "1"
    row[7] += v[0] == "deny"

