"""Reads of the policy: the effective limits of an agent, and the policy as a document."""

from __future__ import annotations

from collections import defaultdict

from django.utils import timezone

from quotas.models import Agent, Limit, Member, ModelPrice, Organization, Override, Team, Tier, ToolCost
from quotas.models.limits import NODE_OWNERS, SPEC_FIELDS
from quotas.policy.document import LimitDoc, NodeDoc, OverrideDoc, PolicyDoc, TierDoc, sort_limits
from quotas.policy.effective import EffectiveLimit, merge_node_limits
from quotas.vocabulary import Level



def agent_path(agent: Agent) -> list:
    """[org, team, member, agent]: the nodes whose limits apply to the agent."""
    member = agent.member
    team = member.team
    return [team.org, team, member, agent]


def agent_effective_limits(*, agent: Agent, now=None) -> list[EffectiveLimit]:
    """Every limit that applies to ``agent``, top-down (org first), in each node's order."""
    now = now or timezone.now()
    limits: list[EffectiveLimit] = []
    for node in agent_path(agent):
        tier_limits = list(node.tier.limits.all()) if node.tier_id else []
        limits.extend(
            merge_node_limits(
                level=node.level,
                node=node.slug,
                tier=node.tier.slug if node.tier_id else None,
                tier_limits=tier_limits,
                own_limits=node.limits.all(),
                overrides=node.overrides.all(),
                now=now,
            )
        )
    return limits


def _spec(row, doc_class=LimitDoc, **extra):
    alert_at = None if row.alert_at is None else tuple(sorted(row.alert_at))
    return doc_class(**{name: getattr(row, name) for name in SPEC_FIELDS}, alert_at=alert_at, **extra)


def policy_export() -> PolicyDoc:
    """The whole policy as a ``PolicyDoc`` (a fixed number of queries, whatever its size)."""
    limits_by_owner: dict[tuple[str, int], list] = defaultdict(list)
    for row in Limit.objects.all():
        owner = next(name for name in ("tier", *NODE_OWNERS) if getattr(row, f"{name}_id"))
        limits_by_owner[owner, getattr(row, f"{owner}_id")].append(_spec(row))
    overrides_by_owner: dict[tuple[str, int], list] = defaultdict(list)
    for row in Override.objects.all():
        owner = next(name for name in NODE_OWNERS if getattr(row, f"{name}_id"))
        overrides_by_owner[owner, getattr(row, f"{owner}_id")].append(
            _spec(row, OverrideDoc, expires_at=row.expires_at, reason=row.reason)
        )
    tier_slugs = dict(Tier.objects.values_list("id", "slug"))

    def node_doc(owner: str, level: Level, row) -> NodeDoc:
        return NodeDoc(
            level=level,
            slug=row.slug,
            name=row.name,
            tier=tier_slugs.get(row.tier_id),
            limits=sort_limits(limits_by_owner[owner, row.id]),
            overrides=sort_limits(overrides_by_owner[owner, row.id]),
        )

    children: dict[tuple[str, int], list[NodeDoc]] = defaultdict(list)
    for agent in Agent.objects.order_by("slug"):
        children["member", agent.member_id].append(node_doc("agent", Level.AGENT, agent))
    for member in Member.objects.order_by("slug"):
        doc = node_doc("member", Level.USER, member)
        doc.children = children["member", member.id]
        children["team", member.team_id].append(doc)
    for team in Team.objects.order_by("slug"):
        doc = node_doc("team", Level.TEAM, team)
        doc.children = children["team", team.id]
        children["org", team.org_id].append(doc)
    orgs = []
    for org in Organization.objects.order_by("slug"):
        doc = node_doc("org", Level.ORG, org)
        doc.children = children["org", org.id]
        orgs.append(doc)

    return PolicyDoc(
        tool_costs=dict(ToolCost.objects.values_list("tool", "weight")),
        model_prices={price.model: (price.input_per_1k, price.output_per_1k) for price in ModelPrice.objects.all()},
        tiers=[
            TierDoc(slug=tier.slug, level=tier.level, description=tier.description,
                    limits=sort_limits(limits_by_owner["tier", tier.id]))
            for tier in Tier.objects.order_by("slug")
        ],
        orgs=orgs,
    )


def known_tiers() -> dict[str, str]:
    """slug -> level of the tiers in the database, for validating a policy file."""
    return dict(Tier.objects.values_list("slug", "level"))
