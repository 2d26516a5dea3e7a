"""merge_node_limits: the tier's limits, replaced by the node's own, replaced by live overrides."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

from quotas.policy.document import LimitDoc, OverrideDoc
from quotas.policy.effective import merge_node_limits
from quotas.vocabulary import Level

NOW = dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.timezone.utc)


def merged(tier_limits=(), own=(), overrides=()):
    limits = merge_node_limits(
        level=Level.AGENT, node="agent-1", tier="standard", tier_limits=tier_limits, own_limits=own,
        overrides=overrides, now=NOW,
    )
    return {(limit.metric, limit.window, limit.tool): (limit.amount, limit.source) for limit in limits}


def test_own_limit_replaces_the_tiers_of_the_same_key_and_adds_others():
    tier = [LimitDoc("tokens", Decimal(25000), 3600), LimitDoc("credits", Decimal(50), 10)]
    own = [LimitDoc("tokens", Decimal(40000), 3600), LimitDoc("requests", Decimal(2), 300, tool="delete_record")]
    assert merged(tier, own) == {
        ("tokens", 3600, ""): (40000, "own"),
        ("credits", 10, ""): (50, "tier standard"),
        ("requests", 300, "delete_record"): (2, "own"),
    }


def test_a_different_window_or_tool_is_a_different_limit():
    tier = [LimitDoc("tokens", Decimal(25000), 3600)]
    own = [LimitDoc("tokens", Decimal(1000), 60), LimitDoc("tokens", Decimal(9000), 3600, tool="llm_call")]
    assert len(merged(tier, own)) == 3


def test_override_replaces_until_it_expires():
    tier = [LimitDoc("tokens", Decimal(25000), 3600)]
    own = [LimitDoc("tokens", Decimal(30000), 3600)]
    live = OverrideDoc("tokens", Decimal(60000), 3600, expires_at=NOW + dt.timedelta(seconds=1), reason="launch")
    expired = OverrideDoc("tokens", Decimal(60000), 3600, expires_at=NOW, reason="launch")
    standing = OverrideDoc("tokens", Decimal(70000), 3600, expires_at=None, reason="vip")
    assert merged(tier, own, [live]) == {("tokens", 3600, ""): (60000, "override")}
    assert merged(tier, own, [expired]) == {("tokens", 3600, ""): (30000, "own")}
    assert merged(tier, (), [expired]) == {("tokens", 3600, ""): (25000, "tier standard")}
    assert merged(tier, own, [standing]) == {("tokens", 3600, ""): (70000, "override")}
