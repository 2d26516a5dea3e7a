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
NAME_MAX, MODEL_MAX = 64, 100  # the longest ids and model names (quotas.vocabulary)
MAX_TS_MS = 253_402_300_800_000  # 10000-01-01: later is no time Postgres can bucket
MAX_AMOUNT = 2**53  # per event; sums of a batch stay far inside a bigint


def add_to_rollups(totals: dict[tuple, list[int]], raw: str) -> None:
    """Add one event (an entry's ``e`` field) to ``totals``: (org, hour_ms, team, user, agent, tool, model) -> MEASURES.

    Tokens and cost count as the budgets count them: a check adds its estimate, a settlement the
    difference between the actual and that estimate, an expiry nothing (the estimate stays; it
    counts one unsettled reservation). So the sums equal what was charged, whatever is still open.
    """
    v = raw.split("|")
    if len(v) != len(FIELDS) or v[0] not in KINDS:
        raise ValueError(f"not a usage event: {raw!r}")
    # Everything checked before anything is added: an entry is counted whole or not at all, and an
    # entry the database would refuse (an id too long, a number out of range) never reaches it.
    if any(len(name) > NAME_MAX for name in v[1:6]) or len(v[6]) > MODEL_MAX:
        raise ValueError(f"not a usage event (a name too long): {raw!r}")
    requests, credits, tokens, input_tokens, output_tokens, cost, est_tokens, est_cost, ts = (
        int(v[i]) for i in (7, 8, 9, 10, 11, 12, 13, 14, 15)
    )
    if not 0 <= ts < MAX_TS_MS or max(map(abs, (requests, credits, tokens, input_tokens, output_tokens, cost,
                                                   est_tokens, est_cost))) >= MAX_AMOUNT:
        raise ValueError(f"not a usage event (a number out of range): {raw!r}")
    key = (v[1], ts // HOUR_MS * HOUR_MS, v[2], v[3], v[4], v[5], v[6])
    row = totals.get(key)
    if row is None:
        row = totals[key] = [0, 0, 0, 0, 0, 0, 0, 0]
    row[0] += requests
    row[1] += credits
    row[2] += tokens - est_tokens
    row[3] += input_tokens
    row[4] += output_tokens
    row[5] += cost - est_cost
    row[6] += v[17] == "1"
    row[7] += v[0] == "deny"
