"""Small server-rendered SVG line plots for the status page: no script, no external anything.

Pure: numbers in, an ``<svg>`` string out. The page's Content-Security-Policy
(``default-src 'none'``) allows inline SVG markup, which is all this emits;
colours are presentation attributes, not style sheets. A ``None`` point is a
gap in its line (no sample that minute), never a zero.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Line", "line_plot", "nice_ceiling"]

WIDTH = 640
HEIGHT = 150
_LEFT, _RIGHT, _TOP, _BOTTOM = 40, 8, 22, 20


@dataclass(frozen=True)
class Line:
    """One series: its label (legend), colour, and whether the area under it is filled."""

    label: str
    colour: str
    points: Sequence[float | None]
    fill: bool = False


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 x 10^k at or above ``value`` (at least 1): the plot's top."""
    if value <= 1:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        top = step * 10.0**exponent
        if top >= value:
            return top
    return 10.0 ** (exponent + 1)  # pragma: no cover - the loop always returns


def _num(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _runs(points: Sequence[float | None]) -> list[list[tuple[int, float]]]:
    """Consecutive non-None points, as (index, value) runs."""
    runs: list[list[tuple[int, float]]] = []
    current: list[tuple[int, float]] = []
    for i, value in enumerate(points):
        if value is None:
            if current:
                runs.append(current)
            current = []
        else:
            current.append((i, float(value)))
    if current:
        runs.append(current)
    return runs


def line_plot(lines: Sequence[Line], *, title: str, x_labels: Sequence[tuple[int, str]],
              plot_id: str) -> str:
    """An SVG of ``lines`` over the same x positions, y from 0 to a round top.

    ``x_labels``: (index, text) pairs under the x axis. Each line is one or
    more ``<polyline class="series" data-series=label>`` (and a ``<polygon>``
    under it when filled), so tests can read what was drawn.
    """
    n = max((len(line.points) for line in lines), default=0)
    values = [v for line in lines for v in line.points if v is not None]
    top = nice_ceiling(max(values, default=0.0))
    plot_w = WIDTH - _LEFT - _RIGHT
    plot_h = HEIGHT - _TOP - _BOTTOM

    def x(i: int) -> float:
        return _LEFT + (plot_w * i / (n - 1) if n > 1 else plot_w / 2)

    def y(v: float) -> float:
        return _TOP + plot_h - plot_h * v / top

    e = html.escape
    parts = [
        f'<svg id="{e(plot_id)}" class="plot" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{e(title)}" xmlns="http://www.w3.org/2000/svg" data-top="{_num(top)}">',
        f"<title>{e(title)}</title>",
    ]
    for frac in (0.0, 0.5, 1.0):  # grid and y labels: 0, half, top
        gy = y(top * frac)
        parts.append(f'<line x1="{_LEFT}" y1="{gy:.1f}" x2="{WIDTH - _RIGHT}" y2="{gy:.1f}" '
                     f'stroke="#e3e6eb" stroke-width="1"/>')
        parts.append(f'<text x="{_LEFT - 5}" y="{gy + 4:.1f}" text-anchor="end" font-size="11" '
                     f'fill="#5b6475">{_num(top * frac)}</text>')
    for index, label in x_labels:
        if 0 <= index < n:
            anchor = "end" if index == n - 1 else "start" if index == 0 else "middle"
            parts.append(f'<text x="{x(index):.1f}" y="{HEIGHT - 5}" text-anchor="{anchor}" '
                         f'font-size="11" fill="#5b6475">{e(label)}</text>')
    legend_x = _LEFT
    for line in lines:
        parts.append(f'<rect x="{legend_x}" y="5" width="12" height="4" fill="{e(line.colour)}"/>')
        parts.append(f'<text x="{legend_x + 16}" y="11" font-size="11" fill="#1d2330">{e(line.label)}</text>')
        legend_x += 24 + 7 * len(line.label)
    for line in lines:
        for run in _runs(line.points):
            if len(run) == 1:  # a lone sample: a dot, as a one-point polyline draws nothing
                (i, v), = run
                parts.append(f'<circle class="series" data-series="{e(line.label)}" cx="{x(i):.1f}" '
                             f'cy="{y(v):.1f}" r="2.5" fill="{e(line.colour)}"/>')
                continue
            coords = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in run)
            if line.fill:
                base = f"{x(run[-1][0]):.1f},{y(0):.1f} {x(run[0][0]):.1f},{y(0):.1f}"
                parts.append(f'<polygon points="{coords} {base}" fill="{e(line.colour)}" '
                             f'fill-opacity="0.18" stroke="none"/>')
            parts.append(f'<polyline class="series" data-series="{e(line.label)}" points="{coords}" '
                         f'fill="none" stroke="{e(line.colour)}" stroke-width="2" '
                         f'stroke-linejoin="round"/>')
    parts.append("</svg>")
    return "".join(parts)
