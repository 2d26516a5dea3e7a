"""RateLimit-Policy and RateLimit (draft-ietf-httpapi-ratelimit-headers), and Retry-After.

One list item per limit that applies, named level:node:metric:window[:tool][:model]:

    RateLimit-Policy: "agent:agent-1:tokens:1h";q=25000;w=3600;qu="tokens", ...
    RateLimit: "agent:agent-1:tokens:1h";r=23000;t=1800, ...

Structured-field integers only: a cost limit is given in micro-USD (qu="usd-micro").
"""

from __future__ import annotations

import calendar
import functools
import datetime as dt
import math
from decimal import Decimal

from quotas.engine import Decision
from quotas.vocabulary import parse_window

UNITS = {"requests": "requests", "credits": "credits", "tokens": "tokens", "cost": "usd-micro",
         "concurrency": "concurrent-requests"}


@functools.lru_cache(maxsize=4096)
def _window_seconds(window: str | None, month: tuple[int, int] | None) -> int | None:
    if not window:
        return None
    if window == "day":
        return 86400
    if window == "month":
        return calendar.monthrange(*month)[1] * 86400
    return parse_window(window)


def _units(metric: str, value) -> int:
    if metric == "cost":
        return int((Decimal(value) * 1_000_000).to_integral_value())
    return int(value)


def _policy_item(level, node, metric, limit, window, tool, model, month) -> tuple[str, str]:
    """(name, RateLimit-Policy item): all that does not change from one answer to the next."""
    parts = [level, node, metric, window or "at-once"]
    parts += [part for part in (tool, model) if part]
    name = '"' + ":".join(parts).replace("\\", "").replace('"', "") + '"'
    item = f"{name};q={_units(metric, limit)}"
    seconds = _window_seconds(window, month)
    if seconds:
        item += f";w={seconds}"
    return name, item + f';qu="{UNITS[metric]}"'


# (name, policy item) by what the item is made of; a plain dict, looked up once per limit of every
# answer (an lru_cache costs more per call), emptied when full.
_policy_items: dict[tuple, tuple[str, str]] = {}
POLICY_ITEMS_MAX = 4096


def ratelimit_headers(decision: Decision, *, retry_after: bool = True) -> dict[str, str]:
    limits = decision.limits
    if not limits:
        return {}
    month = None
    policies, states = [], []
    for limit in limits:
        level, node, metric, amount, window, tool, model = (limit.level, limit.node, limit.metric, limit.limit,
                                                            limit.window, limit.tool, limit.model)
        if window == "month" and month is None:  # a month's length (w) is the current month's
            today = dt.datetime.now(dt.timezone.utc)
            month = (today.year, today.month)
        key = (level, node, metric, amount, window, tool, model, month if window == "month" else None)
        cached = _policy_items.get(key)
        if cached is None:
            if len(_policy_items) >= POLICY_ITEMS_MAX:
                _policy_items.clear()
            cached = _policy_items[key] = _policy_item(*key)
        policies.append(cached[1])
        remaining = limit.remaining
        if metric == "cost" or type(remaining) is not int:
            remaining = _units(metric, remaining)
        states.append(f"{cached[0]};r={remaining};t={-(-limit.reset_ms // 1000)}")
    headers = {"RateLimit-Policy": ", ".join(policies), "RateLimit": ", ".join(states)}
    if retry_after and not decision.allowed and decision.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(decision.retry_after_ms / 1000)))
    return headers
