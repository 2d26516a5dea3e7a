"""The policy tables: the hierarchy, tiers, limits, overrides, prices, API keys.

Postgres is the source of truth for policy, and holds the spend rollups and budget alerts;
nothing here talks to Redis.
"""

from .alerts import BudgetAlert
from .api_keys import ApiKey
from .hierarchy import Agent, Member, Organization, Team, Tier
from .limits import Limit, LimitSpec, Override
from .pricing import ModelPrice, ToolCost
from .spend import DailySpend, HourlySpend, RolledDay, StreamCursor

__all__ = [
    "Agent",
    "ApiKey",
    "BudgetAlert",
    "DailySpend",
    "HourlySpend",
    "Limit",
    "LimitSpec",
    "Member",
    "ModelPrice",
    "Organization",
    "Override",
    "RolledDay",
    "StreamCursor",
    "Team",
    "Tier",
    "ToolCost",
]
