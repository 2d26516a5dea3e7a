"""Dashboard fixtures: the demo policy (Acme Corp) plus Globex, users who may or may not see them,
and spend made through the real engine and drained into the real rollups.
"""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass, field
from decimal import Decimal

import pytest
from django.contrib.auth.models import User
from django.db import transaction

from quotas.engine import QuotaEngine
from quotas.models import Organization
from quotas.policy.document import parse_policy
from quotas.services.engine import get_engine
from quotas.services.policy_load import policy_load
from quotas.services.policy_sync import policy_sync_org
from quotas.services.usage_drain import drain_all
from tests.api.conftest import policy_document
from tests.support import clean_redis

PASSWORD = "correct horse battery staple"
AGENTS = {  # agent: (team, user) in the demo policy
    "agent-1": ("engineering", "alice"),
    "agent-2": ("engineering", "alice"),
    "research-bot": ("engineering", "bob"),
    "copywriter": ("marketing", "carol"),
}
CALLS = [  # (agent, tool, model, estimated tokens, input tokens, output tokens)
    ("agent-1", "llm_call", "gpt-4o", 3000, 2000, 800),
    ("agent-1", "llm_call", "claude-sonnet-4", 2000, 1500, 400),
    ("agent-2", "llm_call", "gpt-4o-mini", 1000, 900, 300),
    ("research-bot", "web_search", "gpt-4o-mini", 500, 400, 100),
    ("copywriter", "llm_call", "claude-sonnet-4", 4000, 3000, 1200),
    ("copywriter", "image_generate", "gpt-4o", 1000, 600, 200),
]


@pytest.fixture(autouse=True)
def fresh_redis():
    clean_redis()
    yield


@pytest.fixture
def policy():
    """Acme and Globex in Postgres and Redis (the test needs a django_db mark)."""
    with transaction.atomic():
        policy_load(doc=parse_policy(policy_document()))
    for org in ("acme-corp", "globex"):
        policy_sync_org(org=Organization.objects.get(slug=org))  # now: on_commit never runs in a test that is one transaction
    return get_engine()


@pytest.fixture
def users(policy):
    staff = User.objects.create_user("staff", password=PASSWORD, is_staff=True)
    viewer = User.objects.create_user("viewer", password=PASSWORD)
    nobody = User.objects.create_user("nobody", password=PASSWORD)
    Organization.objects.get(slug="acme-corp").viewers.add(viewer)
    return {"staff": staff, "viewer": viewer, "nobody": nobody}


@dataclass
class Spent:
    """What the engine charged, per team, model, user and agent: what the dashboard must show."""

    cost: Decimal = Decimal(0)
    requests: int = 0
    denied: int = 0
    by: dict[str, dict[str, Decimal]] = field(default_factory=lambda: {
        k: {} for k in ("team", "user", "agent", "model")})

    def add(self, agent: str, model: str, cost: Decimal) -> None:
        team, user = AGENTS[agent]
        self.cost += cost
        self.requests += 1
        for kind, name in (("team", team), ("user", user), ("agent", agent), ("model", model)):
            self.by[kind][name] = self.by[kind].get(name, Decimal(0)) + cost


def spend(engine: QuotaEngine, spent: Spent, calls=CALLS, *, org: str = "acme-corp") -> Spent:
    for agent, tool, model, tokens, inp, out in calls:
        decision = engine.check(org=org, agent=agent, tool=tool, model=model, tokens=tokens)
        assert decision.allowed, decision
        settled = engine.settle(org=org, reservation=decision.reservation, input_tokens=inp, output_tokens=out)
        spent.add(agent, model, settled.cost)
    return spent


def refuse(engine: QuotaEngine, spent: Spent, *, agent: str = "agent-1", n: int = 2, org: str = "acme-corp") -> None:
    """Checks larger than any budget (agent-1's 25,000 tokens an hour): refused, charged nothing."""
    for _ in range(n):
        assert not engine.check(org=org, agent=agent, tool="llm_call", model="gpt-4o", tokens=10_000_000).allowed
        spent.denied += 1


@pytest.fixture
def spent_today(policy) -> Spent:
    """Acme's CALLS and two refused checks today (UTC, the Redis server's clock), and one Globex call; drained."""
    spent = spend(policy, Spent())
    refuse(policy, spent)
    globex = policy.check(org="globex", agent="globex-bot", tool="llm_call", model="gpt-4o", tokens=100)
    policy.settle(org="globex", reservation=globex.reservation, input_tokens=100, output_tokens=100)
    drain_all()
    return spent


class Clock:
    def __init__(self, ms: int):
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


def spend_over_days(engine: QuotaEngine, days: int, *, seed: int = 5) -> Spent:
    """Random calls of Acme's agents on each of the last ``days`` UTC days before today (a fixed clock)."""
    rng = random.Random(seed)
    spent = Spent()
    today = dt.datetime.now(dt.UTC).replace(hour=9, minute=0, second=0, microsecond=0)
    clock = Clock(0)
    clocked = QuotaEngine(engine.client, key_prefix=engine.keys.prefix, clock=clock, sweep_per_check=0)
    for back in range(days, 0, -1):
        clock.ms = int((today - dt.timedelta(days=back)).timestamp() * 1000)
        calls = rng.sample(CALLS, rng.randint(2, len(CALLS)))
        for call in calls:
            clock.ms += 61_000  # past the credits burst window
            agent, tool, model, tokens, inp, out = call
            scale = rng.uniform(0.3, 3)
            spend(clocked, spent, [(agent, tool, model, tokens, int(inp * scale), int(out * scale))])
        if rng.random() < 0.4:
            refuse(clocked, spent, n=rng.randint(1, 4))
    return spent
