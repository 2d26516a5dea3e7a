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


@functools.lru_cache(maxsize=4096)
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


def ratelimit_headers(decision: Decision, *, retry_after: bool = True) -> dict[str, str]:
    limits = decision.limits
    if not limits:
        return {}
    today = dt.datetime.now(dt.timezone.utc)
    month = (today.year, today.month)
    policies, states = [], []
    for limit in limits:
        name, item = _policy_item(limit.level, limit.node, limit.metric, limit.limit, limit.window, limit.tool,
                                  limit.model, month if limit.window == "month" else None)
        policies.append(item)
        states.append(f"{name};r={_units(limit.metric, limit.remaining)};t={-(-limit.reset_ms // 1000)}")
    headers = {"RateLimit-Policy": ", ".join(policies), "RateLimit": ", ".join(states)}
    if retry_after and not decision.allowed and decision.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(decision.retry_after_ms / 1000)))
    return headers
