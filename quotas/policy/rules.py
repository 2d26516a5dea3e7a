"""What makes a limit well-formed, as messages an operator can act on.

One function serves the admin forms (via ``LimitSpec.clean``) and the policy
file parser, so both say the same thing about the same mistake. The database
constraints in ``quotas.models`` enforce the same rules for writes that skip
both.
"""

from __future__ import annotations

from decimal import Decimal

from quotas.vocabulary import MONEY_METRICS, Metric, Period, choices

NAME_HINT = "letters, digits, '-', '_' and '.'"

# Budget alerts: percents of a budget. A limit's ``alert_at`` None means these for cost and token
# limits and none for other metrics; an explicit empty list means no alerts.
DEFAULT_ALERT_THRESHOLDS: tuple[int, ...] = (50, 80, 100)
ALERT_METRICS = frozenset({Metric.COST, Metric.TOKENS})
MAX_ALERT_PERCENT = 1000


def limit_spec_errors(
    *,
    metric: str,
    amount: Decimal | None,
    window_seconds: int | None,
    period: str,
    tool: str,
    model: str,
    burst: int | None,
    alert_at: list[int] | tuple[int, ...] | None = None,
) -> dict[str, str]:
    """Field name -> message for each rule the spec breaks; empty when it is valid."""
    errors: dict[str, str] = {}
    if metric not in Metric.__members__.values():
        errors["metric"] = f"{metric!r} is not a metric; use one of {choices(Metric)}"
        return errors
    alert_error = alert_at_error(metric=metric, alert_at=alert_at)
    if alert_error:
        errors["alert_at"] = alert_error
    if period and period not in Period.__members__.values():
        errors["period"] = f"{period!r} is not a period; use day or month"

    if amount is not None:
        if amount <= 0:
            errors["amount"] = "must be greater than 0"
        elif metric not in MONEY_METRICS and amount != amount.to_integral_value():
            errors["amount"] = f"{metric} are counted in whole units; use a whole number such as {int(amount) or 1}"

    if metric == Metric.CONCURRENCY:
        if window_seconds is not None or period:
            key = "window" if window_seconds is not None else "period"
            errors[key] = "a concurrency limit counts leases held at once; leave window and period empty"
        if burst is not None:
            errors["burst"] = "a concurrency limit has no burst; leave it empty"
        if tool or model:
            key = "tool" if tool else "model"
            errors[key] = "a concurrency limit applies to the agent's runs, not to one tool or model; leave it empty"
        return errors

    if window_seconds is None and not period:
        errors["window"] = f"a {metric} limit needs a rolling window (30s, 5m, 1h, 1d) or a calendar period (day, month)"
    elif window_seconds is not None and period:
        errors["period"] = "set a rolling window or a calendar period, not both"
    if burst is not None:
        if burst <= 0:
            errors["burst"] = "must be greater than 0"
        elif window_seconds is None:
            errors["burst"] = "burst makes a token bucket over a rolling window; set a window or leave burst empty"
    return errors


def alert_at_error(*, metric: str, alert_at: list[int] | tuple[int, ...] | None) -> str | None:
    """What is wrong with a limit's budget alert thresholds (percents of its amount), or None."""
    if alert_at is None or len(alert_at) == 0:
        return None
    if metric == Metric.CONCURRENCY:
        return "a concurrency limit counts leases held at once, not a budget; leave alert_at empty"
    for percent in alert_at:
        if isinstance(percent, bool) or not isinstance(percent, int):
            return f"{percent!r} is not a percent; use whole numbers such as [50, 80, 100]"
        if not 1 <= percent <= MAX_ALERT_PERCENT:
            return f"{percent} is not a percent from 1 to {MAX_ALERT_PERCENT}; use e.g. [50, 80, 100]"
    repeated = sorted({percent for percent in alert_at if list(alert_at).count(percent) > 1})
    if repeated:
        return f"{', '.join(map(str, repeated))} appears more than once; list each threshold once"
    return None


def alert_thresholds(*, metric: str, alert_at: list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """The thresholds that apply: explicit ones sorted, else the default for cost and token budgets."""
    if alert_at is None:
        return DEFAULT_ALERT_THRESHOLDS if metric in ALERT_METRICS else ()
    return tuple(sorted(alert_at))
