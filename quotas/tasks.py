"""Celery tasks: thin wrappers around services."""

from __future__ import annotations

from celery import shared_task

from quotas.models import Organization
from quotas.services import budget_alerts
from quotas.services.engine import get_engine
from quotas.services.policy_sync import policy_sync_all
from quotas.services.rollups import roll_up_due_days
from quotas.services.usage_drain import drain_all


@shared_task(ignore_result=True)
def sync_policy_all() -> int:
    """Full resync: repairs drift (a flushed or restarted Redis, a missed after-commit sync)."""
    return policy_sync_all()


@shared_task(ignore_result=True)
def sweep_reservations() -> int:
    """Expire overdue reservations of every org (they count at their estimate)."""
    engine = get_engine()
    return sum(engine.sweep(org=slug) for slug in Organization.objects.values_list("slug", flat=True))


@shared_task(ignore_result=True)
def drain_usage() -> int:
    """Move what the usage streams hold into the hourly rollups (skips a stream another drain holds)."""
    return drain_all().events


@shared_task(ignore_result=True)
def roll_up_days() -> int:
    """Daily rollups of the finished days that have none (or whose rollup a late event undid)."""
    return len(roll_up_due_days())


@shared_task(ignore_result=True)
def evaluate_budget_alerts() -> int:
    """Record the budget thresholds crossed by agents that spent since the last run (each is then delivered)."""
    return len(budget_alerts.evaluate_budget_alerts())


@shared_task(bind=True, ignore_result=True, autoretry_for=(budget_alerts.BudgetAlertDeliveryError,),
             retry_backoff=5, retry_backoff_max=600, retry_jitter=True, max_retries=8)
def deliver_budget_alert(self, alert_id: int) -> str | None:
    """POST one budget alert to its org's webhook (or log it); retried with backoff, failed after the last retry."""
    alert = budget_alerts.budget_alert_deliver(alert_id=alert_id, final=self.request.retries >= self.max_retries)
    return alert.status if alert else None
