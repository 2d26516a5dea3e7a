"""Budget alerts: find the budgets that crossed a threshold, record each crossing once, deliver it.

``evaluate_budget_alerts`` (Celery beat, every ``QUOTAS_ALERT_INTERVAL_S``) takes, per org, the
agents the drain saw spend (the Redis set ``Keys.spent_agents``), peeks each agent's limits in
Redis, and for every cost or token budget on its path (and any limit with ``alert_at`` set) records
each threshold its use has reached. A budget of an org, team or user is looked at once per run,
however many of its agents spent.

Once per threshold per period: a ``BudgetAlert`` row is unique per (org, level, node, limit,
period start, threshold), and rows are written with ``INSERT ... ON CONFLICT DO NOTHING``, so two
evaluators at once (or a run repeated) record a crossing once and deliver only what they inserted.
The period start of a calendar budget is 00:00 UTC of its day or month; a rolling window has no
period, so its start is ``floor(now / window) * window``: a rolling budget's alert re-arms once
per window length (a 1h budget that stays above 80% alerts at 80% at most once an hour).

Delivery (``budget_alert_deliver``, run by a Celery task after commit, retried with exponential
backoff): POST JSON to the org's ``alert_webhook_url``; every outcome is one log line on the
``quotas.alerts`` logger; an org without a webhook URL gets its alerts logged only.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import defaultdict
from dataclasses import dataclass
from decimal import Decimal
from typing import Iterable
from urllib.parse import urlsplit

import httpx
import redis
from django.db import DatabaseError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from quotas.engine import QuotaEngine
from quotas.engine.compile import limit_id
from quotas.engine.decision import (LimitState, PolicyNotLoaded, QuotaBackendUnavailable, QuotaError, UnknownAgent,
                                    UnknownOrg)
from quotas.models import Agent, BudgetAlert, Limit, Organization, Override
from quotas.policy.effective import merge_node_limits
from quotas.services.engine import get_engine
from quotas.vocabulary import Level, Period

log = logging.getLogger("quotas.alerts")

POP_BATCH = 500  # agents taken from an org's spent set at a time (one transaction each)
DELIVERY_TIMEOUT_S = 5.0
UNIQUE_FIELDS = ("org", "level", "node", "limit_ref", "period_start", "threshold")


class BudgetAlertDeliveryError(Exception):
    """The webhook failed (error, timeout or non-2xx); the task retries it."""


@dataclass(frozen=True)
class _Budget:
    """A limit of one node that alerts: what its LimitState is matched by, and its thresholds."""

    level: str
    node: str
    limit_id: str
    thresholds: tuple[int, ...]
    window: int | None  # seconds, for a rolling window or a token bucket
    period: str  # "day" / "month" for a calendar budget
    tool: str
    model: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.level, self.node, self.limit_id)


# ---------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------


def evaluate_budget_alerts(*, now: dt.datetime | None = None, engine: QuotaEngine | None = None) -> list[BudgetAlert]:
    """Record every threshold crossed by a budget of an agent that spent since the last run.

    Returns the alerts this call recorded (each is delivered after its transaction commits).
    ``now`` (for period starts and overrides in force) defaults to the engine's clock: Redis's TIME.
    ``engine`` defaults to the process's engine (tests pass one with a fixed clock).
    """
    engine = engine or get_engine()
    now = now or engine_now(engine)
    created: list[BudgetAlert] = []
    for org in Organization.objects.order_by("slug").only("id", "slug", "tier", "alert_webhook_url"):
        try:
            created.extend(budget_alerts_evaluate_org(org=org, now=now, engine=engine))
        except (DatabaseError, redis.RedisError, QuotaError):
            # One org's failure does not hold up the others; its agents are back in its spent set.
            log.exception("budget alerts: evaluating %s failed; its agents are looked at next run", org.slug)
    return created


def budget_alerts_evaluate_org(*, org: Organization, now: dt.datetime, engine: QuotaEngine) -> list[BudgetAlert]:
    """One org: take its spent agents out of Redis a batch at a time, record what they crossed."""
    spent_key = engine.keys.spent_agents(org.slug)
    evaluated: set[tuple[str, str, str]] = set()  # budgets looked at in this run (dedupe across agents)
    created: list[BudgetAlert] = []
    while True:
        # SPOP is atomic: two evaluators never take the same agent; they may both look at a shared
        # (org/team/user) budget through different agents, and the unique row settles that.
        agents = engine.client.spop(spent_key, POP_BATCH)
        if not agents:
            return created
        try:
            with transaction.atomic():
                alerts = budget_alerts_record(_crossings(org, sorted(agents), now, engine, evaluated))
                if alerts:
                    ids = [alert.pk for alert in alerts]
                    transaction.on_commit(lambda ids=ids: _schedule_delivery(ids), robust=True)
        except Exception:
            # Put them back: the next run looks at them again (recording is idempotent).
            try:
                engine.client.sadd(spent_key, *agents)
            except Exception:  # Redis gone too: they come back when the agents spend again
                log.exception("could not put %d agents of %s back in the spent set", len(agents), org.slug)
            raise
        created.extend(alerts)


def _crossings(org: Organization, agent_slugs: list[str], now: dt.datetime, engine: QuotaEngine,
               evaluated: set) -> list[BudgetAlert]:
    """Unsaved alerts for every threshold reached by a budget on these agents' paths, not yet evaluated."""
    agents = list(Agent.objects.filter(org=org, slug__in=agent_slugs).select_related("member__team"))
    budgets = _budgets_by_node(org, agents, now)
    alerts = []
    for agent in agents:
        path = ((Level.ORG, org.slug), (Level.TEAM, agent.member.team.slug), (Level.USER, agent.member.slug),
                (Level.AGENT, agent.slug))
        pending = {budget.key: budget for node in path for budget in budgets.get(node, ())
                   if budget.key not in evaluated}
        if not pending:
            continue  # every budget on its path was looked at through another agent
        # A plain peek shows the limits that apply to any call; a budget narrowed to a tool or a
        # model shows only in a peek of a call of that tool / model.
        calls = sorted({(budget.tool or None, budget.model or None) for budget in pending.values()},
                       key=lambda call: (call[0] or "", call[1] or ""))
        for tool, model in calls:
            try:
                decision = engine.peek(org=org.slug, agent=agent.slug, tool=tool, model=model)
            except UnknownAgent:
                break  # deleted (or not synced yet): nothing to alert about through it
            except (UnknownOrg, PolicyNotLoaded):
                log.warning("budget alerts: the policy of %s is not in Redis; skipped", org.slug)
                return alerts
            if decision.degraded:  # fail-open without Redis: no limits to read; the run fails, the agents go back
                raise QuotaBackendUnavailable("Redis did not answer the peek")
            for state in decision.limits:
                budget = pending.get((state.level, state.node, state.id))
                if budget is None or budget.key in evaluated:
                    continue
                evaluated.add(budget.key)
                alerts.extend(_reached(org, budget, state, now))
    return alerts


def _reached(org: Organization, budget: _Budget, state: LimitState, now: dt.datetime) -> list[BudgetAlert]:
    # A token bucket's "budget" is its capacity; what is drawn from it is used.
    amount = state.burst if state.burst else state.limit
    used = amount - state.remaining
    if amount <= 0 or used <= 0:
        return []
    start = period_start(window=budget.window, period=budget.period, now=now)
    return [
        BudgetAlert(
            org=org.slug, level=state.level, node=state.node, limit_ref=state.id,
            limit_description=describe_state(state), threshold=threshold, period_start=start,
            used=Decimal(used), amount=Decimal(amount), webhook_url=org.alert_webhook_url,
        )
        for threshold in budget.thresholds
        if used * 100 >= amount * threshold
    ]


def budget_alerts_record(alerts: list[BudgetAlert]) -> list[BudgetAlert]:
    """Save unsaved alerts; return those that were new (a crossing already recorded is skipped).

    INSERT ... ON CONFLICT DO NOTHING RETURNING id: only the rows this call inserted come back.

    (``bulk_create(ignore_conflicts=True)`` would not say which rows were new.)
    """
    if not alerts:
        return []
    created_at = timezone.now()
    fields = [field for field in BudgetAlert._meta.concrete_fields if not field.primary_key]
    rows, params = [], []
    for alert in alerts:
        alert.created_at = created_at
        rows.append(f"({', '.join(['%s'] * len(fields))})")
        params.extend(field.get_db_prep_save(getattr(alert, field.attname), connection) for field in fields)
    quote = connection.ops.quote_name
    sql = (
        f"INSERT INTO {quote(BudgetAlert._meta.db_table)} ({', '.join(quote(field.column) for field in fields)}) "
        f"VALUES {', '.join(rows)} "
        f"ON CONFLICT ({', '.join(quote(BudgetAlert._meta.get_field(name).column) for name in UNIQUE_FIELDS)}) "
        f"DO NOTHING RETURNING {quote(BudgetAlert._meta.pk.column)}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        ids = [row[0] for row in cursor.fetchall()]
    return list(BudgetAlert.objects.filter(pk__in=ids).order_by("pk"))


def _budgets_by_node(org: Organization, agents: list[Agent], now: dt.datetime) -> dict[tuple[str, str], list[_Budget]]:
    """(level, node) -> its limits that alert, from its effective limits (tier, own, overrides in force).

    Reads the nodes' limits in a fixed number of queries, whatever the number of agents.
    """
    nodes: dict[tuple[str, int], tuple[Level, object]] = {("org", org.pk): (Level.ORG, org)}
    for agent in agents:
        member = agent.member
        nodes["team", member.team_id] = (Level.TEAM, member.team)
        nodes["member", member.pk] = (Level.USER, member)
        nodes["agent", agent.pk] = (Level.AGENT, agent)
    owned = Q()
    for owner in ("org", "team", "member", "agent"):
        ids = [pk for (name, pk) in nodes if name == owner]
        if ids:
            owned |= Q(**{f"{owner}_id__in": ids})
    own, overrides, tier_limits = defaultdict(list), defaultdict(list), defaultdict(list)
    for limit in Limit.objects.filter(tier__isnull=True).filter(owned):
        own[_owner(limit)].append(limit)
    for override in Override.objects.filter(owned):
        overrides[_owner(override)].append(override)
    tier_ids = {row.tier_id for _, row in nodes.values() if row.tier_id}
    tier_slugs = {}
    for limit in Limit.objects.filter(tier_id__in=tier_ids).select_related("tier"):
        tier_limits[limit.tier_id].append(limit)
        tier_slugs[limit.tier_id] = limit.tier.slug

    budgets: dict[tuple[str, str], list[_Budget]] = {}
    for key, (level, row) in nodes.items():
        effective = merge_node_limits(
            level=level, node=row.slug, tier=tier_slugs.get(row.tier_id), tier_limits=tier_limits.get(row.tier_id, []),
            own_limits=own.get(key, []), overrides=overrides.get(key, []), now=now,
        )
        budgets[level.value, row.slug] = [
            _Budget(level=level.value, node=row.slug, limit_id=limit_id(limit), thresholds=limit.alert_thresholds,
                    window=limit.window, period=limit.period, tool=limit.tool, model=limit.model)
            for limit in effective
            if limit.alert_thresholds and (limit.window or limit.period)
        ]
    return budgets


def _owner(row) -> tuple[str, int]:
    return next((name, getattr(row, f"{name}_id")) for name in ("org", "team", "member", "agent")
                if getattr(row, f"{name}_id"))


def period_start(*, window: int | None, period: str, now: dt.datetime) -> dt.datetime:
    """Start of the period an alert is for: 00:00 UTC of the day / the 1st of the month for a
    calendar budget; ``floor(now / window) * window`` (UTC epoch) for a rolling window."""
    now = now.astimezone(dt.timezone.utc)
    if period == Period.DAY:
        return now.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == Period.MONTH:
        return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    if not window:
        raise ValueError("a budget has a window or a period")
    epoch = int(now.timestamp())
    return dt.datetime.fromtimestamp(epoch - epoch % window, dt.timezone.utc)


def engine_now(engine: QuotaEngine) -> dt.datetime:
    """The time the engine's scripts use: its fixed clock (tests), else the Redis server's TIME."""
    if engine.clock is not None:
        ms = int(engine.clock())
    else:
        seconds, microseconds = engine.client.time()
        ms = seconds * 1000 + microseconds // 1000
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)


def describe_state(state: LimitState) -> str:
    """'cost 500/day', 'tokens 25000/1h [model=gpt-4o]', '(shadow)' appended for shadow limits."""
    amount = state.limit.normalize() if isinstance(state.limit, Decimal) else state.limit
    narrowed = "".join(f" [{label}={value}]" for label, value in (("tool", state.tool), ("model", state.model)) if value)
    burst = f" burst {state.burst}" if state.burst else ""
    return f"{state.metric} {amount:f}/{state.window}{burst}{narrowed}{' (shadow)' if state.shadow else ''}"


def _schedule_delivery(ids: Iterable[int]) -> None:
    from quotas.tasks import deliver_budget_alert  # the tasks module imports this one

    for alert_id in ids:
        deliver_budget_alert.delay(alert_id)


# ---------------------------------------------------------------------------
# Delivery
# ---------------------------------------------------------------------------


def budget_alert_payload(alert: BudgetAlert) -> dict:
    """The JSON POSTed to the webhook. Amounts are JSON numbers (USD for cost, whole tokens)."""
    return {
        "id": alert.pk,
        "org": alert.org,
        "level": alert.level,
        "node": alert.node,
        "limit": alert.limit_description,
        "metric": alert.limit_description.split(" ", 1)[0],
        "threshold": alert.threshold,
        "used": _number(alert.used),
        "amount": _number(alert.amount),
        "period_start": _iso(alert.period_start),
        "created_at": _iso(alert.created_at),
    }


def budget_alert_deliver(*, alert_id: int, final: bool = False, timeout: float = DELIVERY_TIMEOUT_S) -> BudgetAlert | None:
    """One delivery attempt of an alert; raises BudgetAlertDeliveryError when it should be retried.

    ``final``: this is the last attempt (the task has no retries left): a failure marks it failed.
    An alert already sent, logged or failed is left alone (a repeated task delivers nothing twice).
    """
    alert = BudgetAlert.objects.filter(pk=alert_id).first()
    if alert is None or alert.status != BudgetAlert.Status.PENDING:
        return alert
    url = Organization.objects.filter(slug=alert.org).values_list("alert_webhook_url", flat=True).first() or ""
    summary = _summary(alert)
    if not url:
        alert.status = BudgetAlert.Status.LOGGED
        alert.webhook_url = ""
        alert.save(update_fields=["status", "webhook_url"])
        log.info("%s (no webhook URL: logged only)", summary)
        return alert

    alert.attempts += 1
    alert.webhook_url = url
    try:
        response = httpx.post(url, json=budget_alert_payload(alert), timeout=timeout,
                              headers={"User-Agent": "agent-quotas budget alerts"})
        error = None if response.is_success else f"HTTP {response.status_code}: {response.text[:200]}"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    where = _host(url)
    if error is None:
        alert.status = BudgetAlert.Status.SENT
        alert.sent_at = timezone.now()
        alert.save(update_fields=["status", "sent_at", "attempts", "webhook_url"])
        log.info("%s: sent to %s (HTTP %d, attempt %d)", summary, where, response.status_code, alert.attempts)
        return alert
    alert.last_error = error
    alert.status = BudgetAlert.Status.FAILED if final else BudgetAlert.Status.PENDING
    alert.save(update_fields=["status", "attempts", "last_error", "webhook_url"])
    if final:
        log.error("%s: delivery to %s failed for good after %d attempts: %s", summary, where, alert.attempts, error)
    else:
        log.warning("%s: delivery to %s failed (attempt %d, will retry): %s", summary, where, alert.attempts, error)
    raise BudgetAlertDeliveryError(error)


def _summary(alert: BudgetAlert) -> str:
    return (f"budget alert {alert.pk}: {alert.org} {alert.level} {alert.node} {alert.limit_description} "
            f"reached {alert.threshold}% ({_number(alert.used)} of {_number(alert.amount)}, "
            f"period from {_iso(alert.period_start)})")


def _host(url: str) -> str:
    """Scheme and host only: a webhook URL's path often holds a secret token; logs must not."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}"  # no user:password@ either


def _number(value: Decimal) -> int | float:
    value = Decimal(value).normalize()
    return int(value) if value == value.to_integral_value() else float(value)


def _iso(value: dt.datetime) -> str:
    return value.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")
