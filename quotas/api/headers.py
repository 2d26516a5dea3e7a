"""RateLimit-Policy and RateLimit (draft-ietf-httpapi-ratelimit-headers), and Retry-After.

One list item per limit that applies, named level:node:metric:window[:tool][:model]:

    RateLimit-Policy: "agent:agent-1:tokens:1h";q=25000;w=3600;qu="tokens", ...
    RateLimit: "agent:agent-1:tokens:1h";r=23000;t=1800, ...

Structured-field integers only: a cost limit is given in micro-USD (qu="usd-micro").
"""

from __future__ import annotations

import calendar
import datetime as dt
import math
from decimal import Decimal

from quotas.engine import Decision, LimitState

UNITS = {"requests": "requests", "credits": "credits", "tokens": "tokens", "cost": "usd-micro",
         "concurrency": "concurrent-requests"}
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _window_seconds(window: str | None) -> int | None:
    if not window:
        return None
    if window == "day":
        return 86400
    if window == "month":
        today = dt.datetime.now(dt.timezone.utc)
        return calendar.monthrange(today.year, today.month)[1] * 86400
    return int(window[:-1]) * SECONDS[window[-1]]


def _units(limit: LimitState, value) -> int:
    if limit.metric == "cost":
        return int((Decimal(value) * 1_000_000).to_integral_value())
    return int(value)


def _name(limit: LimitState) -> str:
    parts = [limit.level, limit.node, limit.metric, limit.window or "at-once"]
    parts += [part for part in (limit.tool, limit.model) if part]
    return '"' + ":".join(parts).replace("\\", "").replace('"', "") + '"'


def ratelimit_headers(decision: Decision, *, retry_after: bool = True) -> dict[str, str]:
    limits = decision.limits
    if not limits:
        return {}
    policies, states = [], []
    for limit in limits:
        name = _name(limit)
        window = _window_seconds(limit.window)
        policy = f"{name};q={_units(limit, limit.limit)}"
        if window:
            policy += f";w={window}"
        policies.append(policy + f';qu="{UNITS[limit.metric]}"')
        states.append(f"{name};r={_units(limit, limit.remaining)};t={math.ceil(limit.reset_ms / 1000)}")
    headers = {"RateLimit-Policy": ", ".join(policies), "RateLimit": ", ".join(states)}
    if retry_after and not decision.allowed and decision.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(decision.retry_after_ms / 1000)))
    return headers
