"""Numbers as the dashboard writes them: USD with sensible decimals, counts with separators."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal


def usd(value) -> str:
    """$1,234.50; under a dollar two significant digits (at least cents): $0.50, $0.0075, $0.000075."""
    amount = Decimal(value)
    if amount == 0:
        return "$0.00"
    sign = "-" if amount < 0 else ""
    amount = abs(amount)
    decimals = 2 if amount >= 1 else min(9, max(2, -amount.adjusted() + 1))
    rounded = amount.quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP)
    return f"{sign}${rounded:,.{decimals}f}"


def usd_axis(value: float, step: float) -> str:
    """An axis tick: as few decimals as the step needs ($0, $5, $0.25, $0.005)."""
    decimals = 0
    while decimals < 9 and abs(round(step, decimals) - step) > step * 1e-6:
        decimals += 1
    return f"${value:,.{decimals}f}"


def count(value) -> str:
    return f"{int(value):,}"


def amount(value, metric: str) -> str:
    """A limit or its use: USD for cost, a count otherwise."""
    return usd(value) if metric == "cost" else count(value)
