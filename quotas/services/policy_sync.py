"""Policy sync: compile the policy of an org from Postgres and write it to Redis.

Called after every commit that changes policy (``quotas.signals`` schedules
it with ``transaction.on_commit``), by the periodic full resync, by
``manage.py sync_policy``, and by the engine itself when a check finds an
org's policy missing (a flushed or restarted Redis).
"""

from __future__ import annotations

import logging
import threading

import redis
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

from django.db import transaction
from django.utils import timezone

from quotas.engine.compile import NodeLimits, compile_agent, compile_org
from quotas.models import Agent, Limit, Member, ModelPrice, Organization, Override, Team, ToolCost
from quotas.services.engine import get_engine

log = logging.getLogger("quotas.sync")
ALL = "*"
_pending = threading.local()


@dataclass
class _Shared:
    """What every org's policy uses, read once per sync (a full resync shares it between orgs)."""

    version: int
    tier_limits: dict[int, list]
    tool_weights: dict[str, int]
    model_prices: dict[str, tuple]


def _read_shared() -> _Shared:
    """The version is Redis's clock (TIME, in microseconds), read before reading Postgres: every
    process syncing has the same clock, and a write happens only if Redis does not already hold a
    newer version, so a slow full resync never overwrites a later after-commit sync."""
    seconds, microseconds = get_engine().client.time()
    tier_limits: dict[int, list] = defaultdict(list)
    for limit in Limit.objects.filter(tier__isnull=False):
        tier_limits[limit.tier_id].append(limit)
    return _Shared(
        version=seconds * 1_000_000 + microseconds,
        tier_limits=tier_limits,
        tool_weights=dict(ToolCost.objects.values_list("tool", "weight")),
        model_prices={price.model: (price.input_per_1k, price.output_per_1k) for price in ModelPrice.objects.all()},
    )


def policy_sync_org(*, org: Organization, shared: _Shared | None = None) -> int:
    """Write the compiled policy of ``org`` (every agent, tool weights, prices) in one MULTI. Returns agents written."""
    engine = get_engine()
    keys = engine.keys
    now = timezone.now()
    shared = shared or _read_shared()
    version, tier_limits = shared.version, shared.tier_limits
    own: dict[tuple[str, int], list] = defaultdict(list)
    for limit in Limit.objects.filter(tier__isnull=True).filter(_owned_by(org)):
        own[_owner(limit)].append(limit)
    overrides: dict[tuple[str, int], list] = defaultdict(list)
    for override in Override.objects.filter(_owned_by(org)):
        overrides[_owner(override)].append(override)

    def node(level: str, owner: str, row) -> NodeLimits:
        return NodeLimits(
            level=level,
            slug=row.slug,
            tier_limits=tier_limits.get(row.tier_id, []),
            own_limits=own.get((owner, row.id), []),
            overrides=overrides.get((owner, row.id), []),
        )

    org_node = node("org", "org", org)
    teams = {team.id: node("team", "team", team) for team in Team.objects.filter(org=org)}
    members = {member.id: (member.team_id, node("user", "member", member)) for member in Member.objects.filter(org=org)}
    blobs = {}
    for agent in Agent.objects.filter(org=org):
        if agent.member_id not in members or members[agent.member_id][0] not in teams:
            continue  # created while this sync was reading: its own after-commit sync writes it
        team_id, member_node = members[agent.member_id]
        team_node = teams[team_id]
        path = (org.slug, team_node.slug, member_node.slug, agent.slug)
        nodes = (org_node, team_node, member_node, node("agent", "agent", agent))
        blobs[keys.agent_policy(org.slug, agent.slug)] = compile_agent(version=version, path=path, nodes=nodes, now=now)

    org_fields = compile_org(version=version, tool_weights=shared.tool_weights, model_prices=shared.model_prices)
    client = engine.client
    org_key, agents_key = keys.org_policy(org.slug), keys.org_agents(org.slug)
    with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(org_key)
                current = pipe.hget(org_key, "v")
                if current is not None and int(current) >= version:
                    pipe.unwatch()
                    return 0  # a newer snapshot got there first
                stale = set(pipe.smembers(agents_key)) - set(blobs)
                pipe.multi()
                pipe.delete(org_key)
                pipe.hset(org_key, mapping=org_fields)
                if blobs:
                    pipe.mset(blobs)
                for key in stale:
                    pipe.delete(key)
                pipe.delete(agents_key)
                if blobs:
                    pipe.sadd(agents_key, *blobs)
                pipe.execute()
                break
            except redis.WatchError:
                continue
    client.sadd(keys.org_index(), org.slug)  # another hash slot: not in the MULTI (Redis Cluster)
    return len(blobs)


def policy_remove_org(*, slug: str) -> None:
    """Remove an org's policy from Redis (its counters expire by themselves)."""
    engine = get_engine()
    client = engine.client
    agents_key = engine.keys.org_agents(slug)
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(engine.keys.org_policy(slug), agents_key, *client.smembers(agents_key))
        pipe.execute()
    client.srem(engine.keys.org_index(), slug)  # another hash slot: not in the MULTI (Redis Cluster)


def policy_sync_all(*, progress: Callable[[str, int], None] | None = None) -> int:
    """Resync every org and remove the policy of orgs that no longer exist. Returns agents written."""
    total = 0
    slugs = set()
    shared = _read_shared()
    for org in Organization.objects.order_by("slug"):
        count = policy_sync_org(org=org, shared=shared)
        slugs.add(org.slug)
        total += count
        if progress:
            progress(org.slug, count)
    for gone in set(get_engine().client.smembers(get_engine().keys.org_index())) - slugs:
        policy_remove_org(slug=gone)
    return total


def policy_sync_org_by_slug(slug: str) -> bool:
    """The engine's ``on_policy_missing`` hook: load one org's policy if the org exists."""
    org = Organization.objects.filter(slug=slug).first()
    if org is None:
        return False
    log.warning("policy of org %s was missing from Redis; resynced it", slug)
    policy_sync_org(org=org)
    return True


# ---------------------------------------------------------------------------
# After-commit scheduling
# ---------------------------------------------------------------------------


def policy_sync_on_commit(org_ids: Iterable[int | str]) -> None:
    """Sync these orgs (or ALL) once the current transaction commits; at once outside one.

    Many edits in one transaction (a policy file, an admin page with inlines) give one sync per org.
    """
    pending = _pending_orgs()
    pending.update(org_ids)
    transaction.on_commit(_flush_pending)


def _pending_orgs() -> set:
    if not hasattr(_pending, "orgs"):
        _pending.orgs = set()
    return _pending.orgs


def _flush_pending() -> None:
    pending = _pending_orgs()
    if not pending:
        return
    orgs = set(pending)
    pending.clear()
    try:
        if ALL in orgs:
            policy_sync_all()
        else:
            for org in Organization.objects.filter(id__in=orgs):
                policy_sync_org(org=org)
    except Exception:  # the edit is committed; the periodic resync will repair Redis
        log.exception("policy sync after commit failed for %s; the periodic resync will retry", sorted(map(str, orgs)))


def _owned_by(org: Organization):
    from django.db.models import Q

    return Q(org=org) | Q(team__org=org) | Q(member__org=org) | Q(agent__org=org)


def _owner(row) -> tuple[str, int]:
    for name in ("org", "team", "member", "agent"):
        value = getattr(row, f"{name}_id")
        if value:
            return (name, value)
    raise ValueError(f"{row!r} has no owner")
