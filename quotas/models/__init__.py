"""The policy tables: the hierarchy, tiers, limits, overrides, prices, API keys.

Postgres is the source of truth for policy; nothing here talks to Redis.
"""

from .api_keys import ApiKey
from .hierarchy import Agent, Member, Organization, Team, Tier
from .limits import Limit, LimitSpec, Override
from .pricing import ModelPrice, ToolCost

__all__ = [
    "Agent",
    "ApiKey",
    "Limit",
    "LimitSpec",
    "Member",
    "ModelPrice",
    "Organization",
    "Override",
    "Team",
    "Tier",
    "ToolCost",
]
