"""Engine tests: real Valkey, a clock the test controls, a key prefix of its own per test."""

from __future__ import annotations

import datetime as dt
import os
import secrets
from decimal import Decimal

import pytest
import redis

from quotas.engine import Keys, QuotaEngine
from quotas.engine.compile import NodeLimits, compile_agent, compile_org
from quotas.policy.document import LimitDoc, OverrideDoc

START_MS = 1_795_000_000_000  # 2026-11-18T08:26:40Z
PATH = ("acme", "eng", "alice", "agent-1")


class FakeClock:
    """Milliseconds; ``sleep`` advances it, so waiting code runs instantly."""

    def __init__(self, ms: int = START_MS):
        self.ms = ms

    def __call__(self) -> int:
        return self.ms

    def advance(self, ms: int) -> None:
        self.ms += int(ms)

    def sleep(self, seconds: float) -> None:
        self.advance(round(seconds * 1000))

    @property
    def datetime(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.ms / 1000, dt.timezone.utc)


def lim(metric, amount, window=None, **extra) -> LimitDoc:
    """lim("tokens", 25000, "1h") or lim("cost", "0.05", period="day")."""
    from quotas.vocabulary import parse_window

    return LimitDoc(metric, Decimal(str(amount)), parse_window(window) if window else None, **extra)


def override(metric, amount, window=None, *, expires_at=None, **extra) -> OverrideDoc:
    from quotas.vocabulary import parse_window

    return OverrideDoc(metric, Decimal(str(amount)), parse_window(window) if window else None,
                       expires_at=expires_at, reason="test", **extra)


@pytest.fixture
def redis_client():
    client = redis.Redis.from_url(os.environ["REDIS_URL"], decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def prefix(redis_client):
    prefix = f"aqt{secrets.token_hex(4)}"
    yield prefix
    keys = list(redis_client.scan_iter(Keys(prefix).everything(), count=1000))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def engine(redis_client, prefix, clock):
    return QuotaEngine(redis_client, key_prefix=prefix, clock=clock, sleep=clock.sleep, sweep_per_check=0)


class Installer:
    """Writes compiled policy straight to Redis, as policy sync would."""

    def __init__(self, engine: QuotaEngine, clock: FakeClock):
        self.engine, self.clock = engine, clock

    def __call__(self, *, org=(), team=(), user=(), agent=(), path=PATH, tools=None, prices=None, forget_paths=True,
                 version=1):
        keys, client = self.engine.keys, self.engine.client
        nodes = [
            NodeLimits(level, slug, own_limits=[l for l in limits if not isinstance(l, OverrideDoc)],
                       overrides=[l for l in limits if isinstance(l, OverrideDoc)])
            for level, slug, limits in zip(("org", "team", "user", "agent"), path, (org, team, user, agent))
        ]
        client.set(keys.agent_policy(path[0], path[3]),
                   compile_agent(version=version, path=path, nodes=nodes, now=self.clock.datetime))
        fields = compile_org(
            version=version,
            tool_weights=tools if tools is not None else {"web_search": 1, "llm_call": 3, "code_execute": 5},
            model_prices=prices if prices is not None else {"gpt-4o": (Decimal("0.0025"), Decimal("0.01"))},
        )
        client.delete(keys.org_policy(path[0]))
        client.hset(keys.org_policy(path[0]), mapping=fields)
        if forget_paths:
            self.engine.forget_paths()


@pytest.fixture
def install(engine, clock):
    return Installer(engine, clock)


def remaining(decision, metric, level=None):
    for limit in decision.limits:
        if limit.metric == metric and (level is None or limit.level == level):
            return limit.remaining
    raise AssertionError(f"no {metric} limit in {decision.limits}")
