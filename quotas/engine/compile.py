"""The compiled policy the Lua scripts read: what policy sync writes to Redis.

Pure Python. ``compile_agent`` turns the limits of an agent's four nodes into
the JSON blob stored at ``Keys.agent_policy``; ``compile_org`` gives the org
hash (version, tool weights, model prices). Units are the scripts' own:
milliseconds, whole tokens/requests/credits, nano-USD.

A limit in the blob (keys short: it is read on every check)::

    {"id": "9f2c1a3b", "lv": 4, "m": "tokens", "a": 25000, "w": 3600000}   rolling window of 1h
    {..., "p": "day"}                      calendar period instead of "w"
    {..., "b": 50}                         token bucket of capacity 50 (refill a per w)
    {..., "t": "llm_call", "md": "gpt-4o"} narrowed to a tool / model
    {..., "sh": 1}                         shadow: reported, never blocks
    {..., "u": 1767225600000}              an override: in force until this ms
    {..., "f": 1767225600000}              what an expiring override replaced: in force from this ms

An override and the limit it replaces share an id, so they share counters.
"""

from __future__ import annotations

import datetime as dt
import json
import zlib
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal
from typing import Iterable, Protocol

NANOS_PER_USD = Decimal(10) ** 9
LEVEL_INDEX = {"org": 1, "team": 2, "user": 3, "agent": 4}


class Spec(Protocol):
    metric: str
    amount: Decimal
    window: int | None  # seconds
    period: str
    tool: str
    model: str
    burst: int | None
    shadow: bool


def usd_to_nanos(amount: Decimal) -> int:
    return int((Decimal(amount) * NANOS_PER_USD).to_integral_value(rounding=ROUND_CEILING))


def nanos_to_usd(nanos: int | str) -> Decimal:
    return Decimal(int(nanos)) / NANOS_PER_USD


def limit_id(spec: Spec) -> str:
    """Stable across syncs: counters survive an edit of the amount, not a change of what is counted."""
    kind = "bucket" if spec.burst else "window" if spec.window else "period"
    key = "|".join(str(part) for part in (spec.metric, spec.window or "", spec.period, spec.tool, spec.model, kind))
    return f"{zlib.crc32(key.encode()):08x}"


def _units(metric: str, amount: Decimal) -> int:
    return usd_to_nanos(amount) if metric == "cost" else int(amount)


def _entry(level: str, spec: Spec) -> dict:
    entry: dict = {"id": limit_id(spec), "lv": LEVEL_INDEX[level], "m": spec.metric, "a": _units(spec.metric, spec.amount)}
    if spec.window:
        entry["w"] = spec.window * 1000
    if spec.period:
        entry["p"] = spec.period
    if spec.burst:
        entry["b"] = _units(spec.metric, Decimal(spec.burst))
    if spec.tool:
        entry["t"] = spec.tool
    if spec.model:
        entry["md"] = spec.model
    if spec.shadow:
        entry["sh"] = 1
    return entry


def _key(spec: Spec) -> tuple:
    return (spec.metric, spec.window, spec.period, spec.tool, spec.model)


@dataclass
class NodeLimits:
    """One node's limits as the policy has them, before merging."""

    level: str
    slug: str
    tier_limits: list = field(default_factory=list)
    own_limits: list = field(default_factory=list)
    overrides: list = field(default_factory=list)  # objects with .expires_at


def compile_node(node: NodeLimits, now: dt.datetime) -> list[dict]:
    """The tier's limits, replaced by the node's own, replaced by live overrides.

    An override with an expiry is compiled together with what it replaces,
    each with its time span, so the expiry takes effect on the hot path at
    once, without a sync.
    """
    base: dict[tuple, Spec] = {}
    for spec in (*node.tier_limits, *node.own_limits):
        base[_key(spec)] = spec
    entries = []
    overridden = {}
    for override in node.overrides:
        if override.expires_at is not None and override.expires_at <= now:
            continue
        entry = _entry(node.level, override)
        if override.expires_at is not None:
            entry["u"] = int(override.expires_at.timestamp() * 1000)
        overridden[_key(override)] = override.expires_at
        entries.append(entry)
    for key, spec in base.items():
        if key in overridden:
            expires_at = overridden[key]
            if expires_at is None:
                continue  # replaced for good
            entry = _entry(node.level, spec)
            entry["f"] = int(expires_at.timestamp() * 1000)
            entries.append(entry)
        else:
            entries.append(_entry(node.level, spec))
    return entries


def compile_agent(*, version: int, path: tuple[str, str, str, str], nodes: Iterable[NodeLimits], now: dt.datetime) -> str:
    """The agent's blob: its path and every limit of its four nodes."""
    limits = [entry for node in nodes for entry in compile_node(node, now)]
    return json.dumps({"v": version, "p": list(path), "l": limits}, separators=(",", ":"))


def compile_org(*, version: int, tool_weights: dict[str, int], model_prices: dict[str, tuple[Decimal, Decimal]]) -> dict:
    """The org hash: ``v``, ``t:TOOL`` -> weight, ``m:MODEL`` -> "in,out" nano-USD per 1K tokens."""
    fields: dict[str, str | int] = {"v": version}
    for tool, weight in tool_weights.items():
        fields[f"t:{tool}"] = weight
    for model, (price_in, price_out) in model_prices.items():
        fields[f"m:{model}"] = f"{usd_to_nanos(price_in)},{usd_to_nanos(price_out)}"
    return fields
