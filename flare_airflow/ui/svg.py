"""Per-round line charts as server-rendered SVG: no JavaScript, no library, works offline.

Every point is a ``<circle class="point">`` with ``data-series``, ``data-round`` and
``data-value`` (the exact value, ``repr`` of the float) and a ``<title>`` tooltip, so a browser
test -- or a user's inspector -- reads the numbers the chart shows.
"""

from __future__ import annotations

import math
from html import escape

from flare_airflow.ui.view import Chart

WIDTH, HEIGHT = 460, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 130, 28, 40
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        return [low]
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if raw <= step * mult:
            step *= mult
            break
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def render(chart: Chart) -> str:
    """One chart as an inline ``<svg>`` element."""
    points = [p for s in chart.series for p in s.points]
    values = [v for _, v in points]
    if chart.reference is not None:
        values.append(chart.reference[1])
    rounds = sorted({r for r, _ in points})
    parts = [
        f'<svg class="chart" data-chart="{escape(chart.key)}" xmlns="http://www.w3.org/2000/svg" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{escape(chart.title)}">',
        f'<text x="{LEFT}" y="16" class="title">{escape(chart.title)}</text>',
    ]
    if not points:
        parts.append(f'<text x="{LEFT}" y="{HEIGHT // 2}" class="empty">no aggregated round</text></svg>')
        return "".join(parts)
    low, high = min(values), max(values)
    if chart.integer_y:
        low, high = 0.0, max(high, 1.0) + 0.5
    if high == low:
        pad = abs(high) * 0.1 or 1.0
        low, high = low - pad, high + pad
    else:
        pad = (high - low) * 0.08
        low, high = (low if chart.integer_y else low - pad), high + pad
    r_low, r_high = min(rounds), max(rounds)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(r: float) -> float:
        return LEFT + (plot_w / 2 if r_high == r_low else (r - r_low) / (r_high - r_low) * plot_w)

    def y(v: float) -> float:
        return TOP + (high - v) / (high - low) * plot_h

    parts.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" class="frame"/>')
    y_ticks = _ticks(low, high) if not chart.integer_y else list(range(int(high) + 1))
    for t in y_ticks:
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(t):.1f}" y2="{y(t):.1f}" class="grid"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y(t) + 4:.1f}" class="ytick">{_fmt(t)}</text>')
    for r in rounds:
        parts.append(f'<text x="{x(r):.1f}" y="{TOP + plot_h + 16}" class="xtick">{r}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 6}" class="xlabel">round</text>')
    parts.append(
        f'<text x="14" y="{TOP + plot_h / 2:.1f}" class="ylabel" '
        f'transform="rotate(-90 14 {TOP + plot_h / 2:.1f})">{escape(chart.y_label)}</text>'
    )
    legend_y = TOP + 6
    for i, series in enumerate(chart.series):
        color = PALETTE[i % len(PALETTE)]
        name = escape(series.name)
        parts.append(f'<g class="series" data-series="{name}" stroke="{color}" fill="{color}">')
        if len(series.points) > 1:
            path = " ".join(f"{x(r):.1f},{y(v):.1f}" for r, v in series.points)
            parts.append(f'<polyline points="{path}" class="line"/>')
        for r, v in series.points:
            parts.append(
                f'<circle class="point" cx="{x(r):.1f}" cy="{y(v):.1f}" r="3.5" data-series="{name}" '
                f'data-round="{r}" data-value="{v!r}"><title>{name}, round {r}: {_fmt(v)}</title></circle>'
            )
        parts.append("</g>")
        parts.append(
            f'<circle cx="{LEFT + plot_w + 12}" cy="{legend_y}" r="4" fill="{color}"/>'
            f'<text x="{LEFT + plot_w + 20}" y="{legend_y + 4}" class="legend">{name}</text>'
        )
        legend_y += 16
    if chart.reference is not None:
        name, value = chart.reference
        parts.append(
            f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(value):.1f}" y2="{y(value):.1f}" class="reference" '
            f'data-reference="{escape(name)}" data-value="{value!r}"/>'
        )
        parts.append(f'<text x="{LEFT + plot_w + 8}" y="{legend_y + 4}" class="legend">- - {escape(name)}</text>')
        legend_y += 16
    parts.append("</svg>")
    return "".join(parts)
