"""Which limits apply to a node: its tier's, replaced by its own, replaced by active overrides.

Pure Python: the admin's "effective limits" table and the policy compiled for
the hot path both come from ``merge_node_limits``.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from decimal import Decimal
from typing import Iterable, Protocol

from quotas.policy.rules import alert_thresholds
from quotas.vocabulary import Level, format_window


class SpecLike(Protocol):
    metric: str
    amount: Decimal
    window: int | None
    period: str
    tool: str
    model: str
    burst: int | None
    shadow: bool


@dataclass(frozen=True)
class EffectiveLimit:
    level: Level
    node: str
    metric: str
    amount: Decimal
    window: int | None
    period: str
    tool: str
    model: str
    burst: int | None
    shadow: bool
    source: str  # "tier standard-agent", "own", "override"
    expires_at: dt.datetime | None = None  # overrides only
    reason: str = ""
    alert_at: tuple[int, ...] | None = None  # as set on the limit; None: the default for its metric

    @property
    def key(self) -> tuple:
        return (self.metric, self.window, self.period, self.tool, self.model)

    @property
    def alert_thresholds(self) -> tuple[int, ...]:
        """Budget alert thresholds (percents) in force: explicit, or the default for cost and tokens."""
        return alert_thresholds(metric=self.metric, alert_at=self.alert_at)

    @property
    def span(self) -> str:
        return format_window(self.window) if self.window else self.period


def merge_node_limits(
    *,
    level: Level,
    node: str,
    tier: str | None,
    tier_limits: Iterable[SpecLike],
    own_limits: Iterable[SpecLike],
    overrides: Iterable[SpecLike],
    now: dt.datetime,
) -> list[EffectiveLimit]:
    """One node's limits. Keys are (metric, window, period, tool, model).

    The tier's limits apply unless the node has its own of the same key; an
    override that has not expired replaces either.
    """
    merged: dict[tuple, EffectiveLimit] = {}
    sources = ((f"tier {tier}", tier_limits), ("own", own_limits), ("override", overrides))
    for source, specs in sources:
        for spec in specs:
            expires_at = getattr(spec, "expires_at", None)
            alert_at = getattr(spec, "alert_at", None)
            if source == "override" and expires_at is not None and expires_at <= now:
                continue
            limit = EffectiveLimit(
                level=level, node=node, metric=spec.metric, amount=spec.amount, window=spec.window,
                period=spec.period, tool=spec.tool, model=spec.model, burst=spec.burst, shadow=spec.shadow,
                source=source, expires_at=expires_at, reason=getattr(spec, "reason", ""),
                alert_at=None if alert_at is None else tuple(alert_at),
            )
            merged[limit.key] = limit
    return list(merged.values())
