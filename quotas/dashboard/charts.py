"""Charts drawn on the server as inline SVG: no JavaScript, nothing from a CDN.

Every drawn bar segment carries its numbers as data attributes (``data-day``, ``data-group``,
``data-value``) and a ``<title>`` (the browser's hover tooltip).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date
from decimal import Decimal

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from .formatting import count, usd, usd_axis

# The Tableau 10 categorical palette (its grey kept for "other").
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")
OTHER = "#bab0ac"
MAX_SERIES = len(PALETTE)  # groups beyond these are summed into one "other" series

RIGHT, TOP, BOTTOM = 12, 14, 46  # margins around the plot (the left one holds the y axis labels)


@dataclass(frozen=True)
class Series:
    name: str  # what the legend says
    group: str  # the value in the data ("" for no tool/model); "" with other=True for the rest
    color: str
    values: list[Decimal]  # one per day
    other: bool = False

    @property
    def total(self) -> Decimal:
        return sum(self.values, Decimal(0))


def group_label(group: str, group_by: str) -> str:
    return group or {"model": "(no model)", "tool": "(no tool)"}.get(group_by, "(none)")


def spend_series(days: list[date], groups: list[str], by_group_day: dict[str, dict[date, Decimal]],
                 group_by: str) -> list[Series]:
    """One series per group (``groups`` sorted largest first), the smallest beyond MAX_SERIES summed as other."""
    shown = groups if len(groups) <= MAX_SERIES else groups[: MAX_SERIES - 1]
    series = [Series(group_label(group, group_by), group, PALETTE[i],
                     [by_group_day[group].get(day, Decimal(0)) for day in days])
              for i, group in enumerate(shown)]
    rest = groups[len(shown):]
    if rest:
        values = [sum((by_group_day[group].get(day, Decimal(0)) for group in rest), Decimal(0)) for day in days]
        series.append(Series(f"{len(rest)} others", "", OTHER, values, other=True))
    return series


def nice_scale(top: float, ticks: int = 5) -> tuple[float, float]:
    """(axis maximum, tick step) with a 1/2/2.5/5 x 10^n step covering ``top``."""
    if top <= 0:
        return 1.0, 0.25
    raw = top / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return step * math.ceil(top / step - 1e-9), step


def stacked_bars(days: list[date], series: list[Series], *, label: str, money: bool = True,
                 css_class: str = "chart", width: int = 960, height: int = 300) -> SafeString:
    """A stacked bar per day: one segment per series with a value above zero.

    ``width`` x ``height`` is the viewBox: about the size the chart is shown at, so that its text
    is as large as the page's.
    """
    WIDTH, HEIGHT, LEFT = width, height, 72 if money else 48
    totals = [sum((s.values[i] for s in series), Decimal(0)) for i in range(len(days))]
    fmt = usd if money else count
    axis_max, step = nice_scale(float(max(totals, default=0)))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / max(len(days), 1)
    bar_w = max(slot * 0.72, 1.0)

    def y(value: float) -> float:
        return TOP + plot_h - value / axis_max * plot_h

    out = [f'<svg class="{escape(css_class)}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
           f'aria-label="{escape(label)}" preserveAspectRatio="xMidYMid meet" xmlns="http://www.w3.org/2000/svg">']
    # Grid and y axis.
    n_ticks = round(axis_max / step)
    for i in range(n_ticks + 1):
        value = i * step
        ty = y(value)
        out.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{ty:.1f}" y2="{ty:.1f}"/>')
        text = usd_axis(value, step) if money else f"{value:,.{0 if step >= 1 else 2}f}"
        out.append(f'<text class="tick" x="{LEFT - 8}" y="{ty + 4:.1f}" text-anchor="end">{escape(text)}</text>')
    out.append(f'<text class="axis-title" transform="translate(14 {TOP + plot_h / 2:.0f}) rotate(-90)" '
               f'text-anchor="middle">{escape(label)}</text>')
    # Bars.
    for i, day in enumerate(days):
        x = LEFT + i * slot + (slot - bar_w) / 2
        base = 0.0
        for s in series:
            value = s.values[i]
            if value <= 0:
                continue
            top = base + float(value)
            y0, y1 = y(top), y(base)
            title = f"{day.isoformat()} · {s.name}: {fmt(value)} (day total {fmt(totals[i])})"
            out.append(
                f'<rect class="seg" x="{x:.2f}" y="{y0:.2f}" width="{bar_w:.2f}" height="{max(y1 - y0, 0.5):.2f}" '
                f'fill="{s.color}" data-day="{day.isoformat()}" data-group="{escape(s.group)}" '
                f'data-series="{escape(s.name)}" data-value="{value}"><title>{escape(title)}</title></rect>'
            )
            base = top
    # X axis: a day label every 60 units or more.
    every = max(1, math.ceil(len(days) / max(plot_w // 60, 1)))
    axis_y = TOP + plot_h
    out.append(f'<line class="axis" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{axis_y}" y2="{axis_y}"/>')
    for i, day in enumerate(days):
        if (len(days) - 1 - i) % every:  # keep the last day labelled
            continue
        cx = LEFT + i * slot + slot / 2
        out.append(f'<text class="tick" x="{cx:.1f}" y="{axis_y + 18}" text-anchor="middle">'
                   f'{day.strftime("%b")} {day.day}</text>')
    out.append(f'<text class="axis-title" x="{LEFT + plot_w / 2:.0f}" y="{HEIGHT - 4}" text-anchor="middle">'
               f'Day (UTC)</text>')
    out.append("</svg>")
    return mark_safe("".join(out))
