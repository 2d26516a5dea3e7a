"""Policy edits reach Redis after their commit: each save or delete schedules a sync of its org."""

from __future__ import annotations

from django.db.models.signals import post_delete, post_save, pre_save

from quotas.models import Agent, Limit, Member, ModelPrice, Organization, Override, Team, Tier, ToolCost
from quotas.services.policy_sync import ALL, policy_sync_on_commit


def _orgs_of(instance) -> set:
    if isinstance(instance, Organization):
        return {instance.id}
    if isinstance(instance, (Team, Member, Agent)):
        return {instance.org_id}
    if isinstance(instance, (Limit, Override)):
        if getattr(instance, "tier_id", None):
            return {ALL}
        for owner in ("team", "member", "agent"):
            if getattr(instance, f"{owner}_id"):
                return {getattr(instance, owner).org_id}
        return {instance.org_id}
    return {ALL}  # tiers, tool costs, model prices: every org may use them


def _remember_old_org(sender, instance, raw=False, **kwargs):
    """A node, limit or override moved to another org must leave the old org's policy too."""
    if raw or not instance.pk:
        return
    old = sender.objects.filter(pk=instance.pk).first()
    if old is not None:
        instance._quotas_old_orgs = _orgs_of(old)


def _on_save(sender, instance, raw=False, **kwargs):
    if not raw:
        policy_sync_on_commit(_orgs_of(instance) | getattr(instance, "_quotas_old_orgs", set()))


def _on_delete(sender, instance, **kwargs):
    # A deleted org (or a child whose parent is being deleted) may be gone before we look: resync all.
    try:
        orgs = {ALL} if isinstance(instance, Organization) else _orgs_of(instance)
    except Exception:  # the owner row was deleted in the same cascade
        orgs = {ALL}
    policy_sync_on_commit(orgs)


def connect() -> None:
    for model in (Team, Member, Agent, Limit, Override):
        pre_save.connect(_remember_old_org, sender=model, dispatch_uid=f"quotas-sync-old-org-{model.__name__}")
    for model in (Organization, Team, Member, Agent, Limit, Override, Tier, ToolCost, ModelPrice):
        post_save.connect(_on_save, sender=model, dispatch_uid=f"quotas-sync-save-{model.__name__}")
        post_delete.connect(_on_delete, sender=model, dispatch_uid=f"quotas-sync-delete-{model.__name__}")
