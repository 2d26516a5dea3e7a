"""Celery tasks: thin wrappers around services."""

from __future__ import annotations

from celery import shared_task

from quotas.models import Organization
from quotas.services.engine import get_engine
from quotas.services.policy_sync import policy_sync_all


@shared_task(ignore_result=True)
def sync_policy_all() -> int:
    """Full resync: repairs drift (a flushed or restarted Redis, a missed after-commit sync)."""
    return policy_sync_all()


@shared_task(ignore_result=True)
def sweep_reservations() -> int:
    """Expire overdue reservations of every org (they count at their estimate)."""
    engine = get_engine()
    return sum(engine.sweep(org=slug) for slug in Organization.objects.values_list("slug", flat=True))
