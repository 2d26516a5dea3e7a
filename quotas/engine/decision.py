"""What the engine answers: value objects and errors. No Redis, no Django."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple
from decimal import Decimal

LEVELS = ("org", "team", "user", "agent")


class LimitState(NamedTuple):
    """One limit that applies, and what remains of it (a named tuple: eight are made per check)."""

    level: str
    node: str
    metric: str
    limit: int | Decimal  # Decimal USD for cost
    remaining: int | Decimal
    window: str | None  # "1h", or the period "day" / "month"; None for concurrency
    tool: str | None
    model: str | None
    reset_ms: int
    shadow: bool
    burst: int | Decimal | None = None
    id: str = ""
    passed: bool = True

    def as_dict(self) -> dict:
        return {
            "level": self.level, "node": self.node, "metric": self.metric, "limit": self.limit,
            "remaining": self.remaining, "window": self.window, "tool": self.tool, "model": self.model,
            "reset_ms": self.reset_ms, "shadow": self.shadow,
        }


class Decision:
    """The answer to a check (or a lease): allowed or not, which limit blocked, when it would pass.

    ``limits`` (every limit that applied, with what remains) is built on first use: a caller that
    only needs ``allowed`` does not pay for it.
    """

    __slots__ = ("allowed", "retry_after_ms", "reservation", "degraded", "_blocked", "_rows", "_describe", "_limits")

    def __init__(self, allowed: bool, *, retry_after_ms: int | None = None, reservation: str | None = None,
                 degraded: bool = False, blocked: int = 0, rows=(), describe=None, limits=None):
        self.allowed = allowed
        self.retry_after_ms = retry_after_ms  # None when allowed, or when the request can never pass
        self.reservation = reservation
        self.degraded = degraded  # admitted without Redis (fail-open)
        self._blocked = blocked  # 1-based position in limits, 0 for none
        self._rows = rows
        self._describe = describe
        self._limits = limits

    @property
    def limits(self) -> list[LimitState]:
        if self._limits is None:
            self._limits = self._describe(self._rows) if self._describe else []
        return self._limits

    @property
    def blocked_by(self) -> LimitState | None:
        return self.limits[self._blocked - 1] if self._blocked else None

    @property
    def would_block(self) -> list[LimitState]:
        """Shadow limits that would have blocked."""
        return [limit for limit in self.limits if limit.shadow and not limit.passed]

    def __bool__(self) -> bool:
        return self.allowed

    def __repr__(self) -> str:
        return (f"Decision(allowed={self.allowed}, retry_after_ms={self.retry_after_ms}, "
                f"blocked_by={self.blocked_by!r}, reservation={self.reservation!r})")


@dataclass(frozen=True)
class Settlement:
    reservation: str
    status: str  # "settled", "repeat" (already settled: same answer), "expired" (counted at its estimate)
    tokens: int | None
    cost: Decimal | None
    estimated_tokens: int
    estimated_cost: Decimal


class QuotaError(Exception):
    """Base of the engine's errors."""


class QuotaExceeded(QuotaError):
    """Raised by ``acquire`` / ``lease`` when the limit does not free up in time; carries the last decision."""

    def __init__(self, decision: Decision):
        self.decision = decision
        blocked = decision.blocked_by
        what = f"{blocked.level} {blocked.node} {blocked.metric} {blocked.limit}/{blocked.window or 'at once'}" if blocked else "a limit"
        when = "never (the request is larger than the limit)" if decision.retry_after_ms is None else f"in {decision.retry_after_ms} ms"
        super().__init__(f"blocked by {what}; would pass {when}")

    @property
    def retry_after_ms(self) -> int | None:
        return self.decision.retry_after_ms

    @property
    def blocked_by(self) -> LimitState | None:
        return self.decision.blocked_by


class UnknownOrg(QuotaError, LookupError):
    def __init__(self, org: str):
        self.org = org
        super().__init__(f"unknown org {org!r}: no policy for it in Redis (is it in the database, and synced?)")


class UnknownAgent(QuotaError, LookupError):
    def __init__(self, org: str, agent: str):
        self.org, self.agent = org, agent
        super().__init__(f"unknown agent {agent!r} in org {org!r}")


class UnknownReservation(QuotaError, LookupError):
    def __init__(self, reservation: str):
        self.reservation = reservation
        super().__init__(f"unknown reservation {reservation!r} (never made, or settled/expired too long ago)")


class UnknownLease(QuotaError, LookupError):
    def __init__(self, lease: str):
        self.lease = lease
        super().__init__(f"lease {lease!r} is not held (released, expired, or never granted)")


class PolicyNotLoaded(QuotaError):
    """The org's policy is not in Redis (flushed, restarted, new server) and no resync hook could load it."""

    def __init__(self, org: str):
        self.org = org
        super().__init__(f"the policy of org {org!r} is not in Redis; run `manage.py sync_policy`")


class QuotaBackendUnavailable(QuotaError):
    """Redis could not be reached in time and the fail mode is closed."""
