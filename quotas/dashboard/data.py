"""What the dashboard shows: reads only (Postgres rollups and Redis budgets), no HTML.

Spend comes from quotas.services.reports (the same numbers as the reports API and its CSV); the
totals over a range are one query of the same shape (rolled-up days from DailySpend, others from
HourlySpend). Budgets are read from Redis with ``QuotaEngine.peek`` (consumes nothing) for a bounded
number of agents: an org may have thousands.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date, timedelta
from decimal import Decimal

import redis
from django.contrib.auth.models import AbstractBaseUser
from django.db import connection

from quotas.engine import QuotaError, UnknownAgent
from quotas.engine.decision import LEVELS, LimitState
from quotas.models import Agent, Organization
from quotas.services.engine import get_engine
from quotas.models.spend import column
from quotas.services.reports import SpendRow, daily_spend, days_in, spend_in_range, spend_params
from quotas.services.rollups import today_utc

log = logging.getLogger(__name__)

DEFAULT_DAYS = 14
MAX_DAYS = 366
CHART_GROUPS = ("team", "model", "user", "agent", "tool")
TOP = 10  # rows in the top users / top agents tables
# Budgets: how many agents are peeked in Redis at most (one round trip each), and how many of the
# agents' own budgets are listed.
MAX_PEEKS = 40
TOP_AGENT_BUDGETS = 10
BUDGET_METRICS = ("cost", "tokens")


# -- who sees what ------------------------------------------------------------------------------


def visible_orgs(user: AbstractBaseUser) -> list[Organization]:
    """Staff see every org; anyone else the orgs they are a viewer of."""
    orgs = Organization.objects.order_by("slug")
    if not user.is_staff:
        orgs = orgs.filter(viewers=user)
    return list(orgs)


def default_range(today: date | None = None) -> tuple[date, date]:
    end = today or today_utc()
    return end - timedelta(days=DEFAULT_DAYS - 1), end


# -- spend --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Total:
    """Spend of one user or agent over the range."""

    org: str
    name: str
    owner: str  # the user an agent spent under (the latest, if it moved); the team of a user
    requests: int
    tokens: int
    cost: Decimal
    denied: int


@dataclass
class Spend:
    """The range's daily spend by one grouping, and what the page derives from it."""

    start: date
    end: date
    group_by: str
    rows: list[SpendRow]
    days: list[date] = field(init=False)
    groups: list[str] = field(init=False)  # by total cost, largest first (ties: by name)
    cost_by_group_day: dict[str, dict[date, Decimal]] = field(init=False)
    denied_by_day: dict[date, int] = field(init=False)
    total_cost: Decimal = field(init=False)
    total_requests: int = field(init=False)
    total_tokens: int = field(init=False)
    total_denied: int = field(init=False)

    def __post_init__(self) -> None:
        self.days = days_in(self.start, self.end)
        self.cost_by_group_day = defaultdict(dict)
        self.denied_by_day = {day: 0 for day in self.days}
        totals: dict[str, Decimal] = defaultdict(Decimal)
        for row in self.rows:
            self.cost_by_group_day[row.group][row.day] = row.cost
            self.denied_by_day[row.day] += row.denied
            totals[row.group] += row.cost
        self.groups = sorted(totals, key=lambda group: (-totals[group], group))
        self.total_cost = sum((row.cost for row in self.rows), Decimal(0))
        self.total_requests = sum(row.requests for row in self.rows)
        self.total_tokens = sum(row.tokens for row in self.rows)
        self.total_denied = sum(row.denied for row in self.rows)

    @property
    def empty(self) -> bool:
        return not self.rows


def spend_over(*, orgs: list[str], start: date, end: date, group_by: str) -> Spend:
    return Spend(start, end, group_by, daily_spend(orgs=orgs, start=start, end=end, group_by=group_by))


def top_spenders(*, orgs: list[str], start: date, end: date, by: str, limit: int = TOP) -> list[Total]:
    """The ``limit`` users or agents (``by``) that spent the most over the range, by cost then tokens."""
    if by not in ("user", "agent"):
        raise ValueError("by must be user or agent")
    owner_of = {"user": "team", "agent": "user"}[by]
    group, owner = column(by), column(owner_of)
    # The rows of reports.daily_spend, summed over the whole range. The owner is the one of the
    # newest row (an agent moved to another user keeps its past spend where it was spent).
    sql = f"""
        SELECT org, {group}, (ARRAY_AGG({owner} ORDER BY day DESC))[1], SUM(requests), SUM(tokens), SUM(cost),
               SUM(denied)
          FROM {spend_in_range(["org", group, owner])}
         GROUP BY org, {group}
        HAVING SUM(requests) > 0 OR SUM(denied) > 0
         ORDER BY SUM(cost) DESC, SUM(tokens) DESC, org, {group}
         LIMIT %(limit)s
    """
    params = {**spend_params(orgs, start, end), "limit": limit}
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return [Total(org, name, own, int(requests), int(tokens), Decimal(cost), int(denied))
                for org, name, own, requests, tokens, cost, denied in cur.fetchall()]


# -- budgets now (Redis) ------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    level: str
    node: str
    metric: str  # cost or tokens
    window: str | None  # "1h", or the period "day" / "month"
    tool: str | None
    model: str | None
    limit: int | Decimal
    used: int | Decimal
    shadow: bool
    reset_ms: int

    @property
    def percent(self) -> float:
        return float(self.used) / float(self.limit) * 100 if self.limit else 0.0

    @property
    def state(self) -> str:
        percent = self.percent
        return "over" if percent >= 100 else "high" if percent >= 80 else "ok"


@dataclass
class Budgets:
    rows: list[Budget]  # org, team and user budgets, then the agents' with the highest use
    agents_peeked: int
    agents_in_org: int
    error: str = ""  # Redis could not answer: shown instead of the bars


def budgets_now(*, org: str, top_agents: list[str], top_users: list[str]) -> Budgets:
    """Each cost and token budget's use now, from Redis.

    Peeks, in this order, until MAX_PEEKS agents: the agents that spent most over the range, one
    agent of each of the top users, one agent of each team (so every team's budgets show), then any
    agent (so the org's show even without spend). Budgets of the levels above the agent are the
    same whichever agent of theirs is peeked.
    """
    candidates = list(dict.fromkeys(top_agents))
    agents = Agent.objects.filter(org__slug=org)
    by_user = dict(agents.filter(member__slug__in=top_users).order_by("member_id", "slug")
                   .distinct("member_id").values_list("member__slug", "slug"))
    candidates += [by_user[user] for user in top_users if user in by_user]
    candidates += agents.order_by("member__team_id", "slug").distinct("member__team_id").values_list("slug", flat=True)[:MAX_PEEKS]
    candidates += agents.order_by("slug").values_list("slug", flat=True)[:1]
    candidates = list(dict.fromkeys(candidates))[:MAX_PEEKS]

    engine = get_engine()
    seen: dict[tuple, Budget] = {}
    peeked = 0
    for agent in candidates:
        try:
            decision = engine.peek(org=org, agent=agent)
        except UnknownAgent:  # deleted since it spent, or not synced yet: nothing to peek
            continue
        except (QuotaError, redis.RedisError) as exc:
            log.warning("dashboard: budgets of %s not read from Redis: %s", org, exc)
            return Budgets([], peeked, agents.count(), error=str(exc))
        if decision.degraded:
            return Budgets([], peeked, agents.count(),
                           error="Redis is unreachable (fail-open): budget use is unknown right now.")
        peeked += 1
        for state in decision.limits:
            if state.metric in BUDGET_METRICS:
                budget = _budget(state)
                seen.setdefault((budget.level, budget.node, budget.metric, budget.window, budget.tool,
                                 budget.model), budget)
    above = sorted((b for b in seen.values() if b.level != "agent"),
                   key=lambda b: (LEVELS.index(b.level), -b.percent, b.node, b.metric))
    agent_rows = sorted((b for b in seen.values() if b.level == "agent"), key=lambda b: (-b.percent, b.node))
    return Budgets(above + agent_rows[:TOP_AGENT_BUDGETS], peeked, agents.count())


def _budget(state: LimitState) -> Budget:
    used = max(state.limit - state.remaining, 0)
    return Budget(state.level, state.node, state.metric, state.window, state.tool, state.model,
                  state.limit, used, state.shadow, state.reset_ms)


# -- the whole page -----------------------------------------------------------------------------


@dataclass
class Dashboard:
    orgs: list[str]  # one org, or several summed (staff: "all organizations")
    spend: Spend
    top_users: list[Total]
    top_agents: list[Total]
    budgets: Budgets | None  # None when several orgs are shown


def dashboard_data(*, orgs: list[str], start: date, end: date, group_by: str) -> Dashboard:
    spend = spend_over(orgs=orgs, start=start, end=end, group_by=group_by)
    top_users = top_spenders(orgs=orgs, start=start, end=end, by="user")
    top_agents = top_spenders(orgs=orgs, start=start, end=end, by="agent")
    budgets = None
    if len(orgs) == 1:
        budgets = budgets_now(org=orgs[0], top_agents=[t.name for t in top_agents],
                              top_users=[t.name for t in top_users])
    return Dashboard(orgs, spend, top_users, top_agents, budgets)
