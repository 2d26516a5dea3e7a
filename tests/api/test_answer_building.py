"""The check answer's body and headers are built for speed; they must be byte for byte what the plain
way builds: LimitState.as_dict() rendered by orjson with its hook for Decimal and its option for
keys of any type, in one piece, and one lru-cached policy item per limit (the reference
implementations below)."""

from __future__ import annotations

import calendar
import datetime as dt
import functools
import math
from decimal import Decimal

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from rest_framework.exceptions import ErrorDetail

from quotas.api.headers import ratelimit_headers
from quotas.api.renderers import FastJSONRenderer, _default, render_json
from quotas.api.views import decision_json
from quotas.engine import Decision, LimitState
from quotas.engine.compile import nanos_to_usd
from quotas.vocabulary import parse_window

# -- the reference implementations ---------------------------------------------------------------


def reference_render(data) -> bytes:
    if data is None:
        return b""
    return orjson.dumps(data, default=_default, option=orjson.OPT_NON_STR_KEYS)


def reference_decision_json(decision: Decision) -> dict:
    limits = [limit.as_dict() for limit in decision.limits]
    if decision.allowed:
        body = {"allowed": True, "reservation": decision.reservation, "limits": limits,
                "would_block": [limit.as_dict() for limit in decision.would_block]}
    else:
        body = {"allowed": False, "blocked_by": decision.blocked_by.as_dict(),
                "retry_after_ms": decision.retry_after_ms, "limits": limits}
    if decision.degraded:
        body["degraded"] = True
    return body


UNITS = {"requests": "requests", "credits": "credits", "tokens": "tokens", "cost": "usd-micro",
         "concurrency": "concurrent-requests"}


def _units(metric, value) -> int:
    if metric == "cost":
        return int((Decimal(value) * 1_000_000).to_integral_value())
    return int(value)


@functools.lru_cache(maxsize=64)
def _policy_item(level, node, metric, limit, window, tool, model, month):
    parts = [level, node, metric, window or "at-once"] + [part for part in (tool, model) if part]
    name = '"' + ":".join(parts).replace("\\", "").replace('"', "") + '"'
    item = f"{name};q={_units(metric, limit)}"
    seconds = (None if not window else 86400 if window == "day"
               else calendar.monthrange(*month)[1] * 86400 if window == "month" else parse_window(window))
    if seconds:
        item += f";w={seconds}"
    return name, item + f';qu="{UNITS[metric]}"'


def reference_headers(decision: Decision, *, retry_after: bool = True) -> dict:
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


# -- what the engine answers -------------------------------------------------------------------------

names = st.sampled_from(["acme-corp", "engineering", "alice", "agent-1", "web_search", "a", "x" * 64])
amounts = st.integers(0, 10**12)
usd = st.integers(0, 10**15).map(nanos_to_usd)  # as the engine converts nano-USD


@st.composite
def limit_states(draw):
    metric = draw(st.sampled_from(["requests", "credits", "tokens", "cost", "concurrency"]))
    amount, remaining = (draw(usd), draw(usd)) if metric == "cost" else (draw(amounts), draw(amounts))
    window = None if metric == "concurrency" else draw(st.sampled_from(["1h", "10s", "5m", "1d", "30s", "day", "month"]))
    return LimitState(
        level=draw(st.sampled_from(["org", "team", "user", "agent"])), node=draw(names), metric=metric, limit=amount,
        remaining=remaining, window=window, tool=draw(st.none() | names), model=draw(st.none() | names),
        reset_ms=draw(st.integers(0, 40 * 86400 * 1000)), shadow=draw(st.booleans()), passed=draw(st.booleans()),
    )


@st.composite
def decisions(draw):
    limits = draw(st.lists(limit_states(), max_size=10))
    allowed = draw(st.booleans()) or not limits
    return Decision(
        allowed, retry_after_ms=None if allowed else draw(st.none() | st.integers(0, 10**9)),
        reservation=draw(st.none() | st.just("5f0c9a1b2c3d4e5f.engineering.alice.agent-1")) if allowed else None,
        degraded=draw(st.booleans()), blocked=0 if allowed else draw(st.integers(1, len(limits))), limits=limits,
    )


@settings(max_examples=400, deadline=None)
@given(decision=decisions())
def test_the_body_is_the_reference_body_byte_for_byte(decision):
    assert FastJSONRenderer().render(decision_json(decision)) == reference_render(reference_decision_json(decision))


@settings(max_examples=150, deadline=None)
@given(batch=st.lists(decisions() | st.just({"error": "not_found", "detail": "no agent 'x' in this organization"}),
                      min_size=1, max_size=5))
def test_a_batch_written_check_by_check_is_the_reference_body(batch):
    """The batch view writes each decision's answer as it goes (orjson.Fragment): the same bytes."""
    pieces = [item if isinstance(item, dict) else orjson.Fragment(render_json(decision_json(item))) for item in batch]
    reference = [item if isinstance(item, dict) else reference_decision_json(item) for item in batch]
    assert FastJSONRenderer().render({"results": pieces}) == reference_render({"results": reference})


@settings(max_examples=400, deadline=None)
@given(decision=decisions(), retry_after=st.booleans())
def test_the_headers_are_the_reference_headers(decision, retry_after):
    assert ratelimit_headers(decision, retry_after=retry_after) == reference_headers(decision, retry_after=retry_after)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
    | st.decimals(allow_nan=False, allow_infinity=False) | st.dates(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.text(max_size=5) | st.integers() | st.text(max_size=5).map(ErrorDetail) | st.dates(), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(data=json_values)
def test_the_renderer_writes_what_it_wrote_with_keys_of_any_type(data):
    def outcome(render):
        try:
            return render(data)
        except TypeError as error:  # an integer over 64 bits, say: the same error either way
            return type(error), str(error)

    assert outcome(FastJSONRenderer().render) == outcome(reference_render)
