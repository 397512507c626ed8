"""Stacked bar charts as SVG geometry, computed on the server (plain Python).

The overview draws its charts with no JavaScript and nothing from a CDN: this
module turns counts per bucket into rectangles, grid lines and axis labels,
and the template writes them out as `<svg>` elements. Coordinates are
pre-formatted strings, so the template never localizes a number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BarChart", "GridLine", "Rect", "Series", "Tick", "nice_ceiling", "stacked_bars"]

# Plot margins inside the SVG: room for the y labels on the left, x labels below.
_LEFT, _RIGHT, _TOP, _BOTTOM = 40, 8, 8, 22


def _f(value: float) -> str:
    return f"{value:.1f}"


@dataclass(frozen=True)
class Series:
    name: str  # a CSS class and the legend label
    counts: Sequence[int]  # one per bucket


@dataclass(frozen=True)
class Rect:
    x: str
    y: str
    width: str
    height: str
    series: str
    bucket: str
    count: int


@dataclass(frozen=True)
class Tick:
    x: str
    label: str


@dataclass(frozen=True)
class GridLine:
    y: str
    label: str


@dataclass(frozen=True)
class BarChart:
    title: str
    width: int
    height: int
    left: str
    right: str
    baseline: str
    rects: tuple[Rect, ...]
    ticks: tuple[Tick, ...]
    grid: tuple[GridLine, ...]
    legend: tuple[tuple[str, int], ...]  # (series, total over the window)
    peak: int  # the top of the y axis

    @property
    def total(self) -> int:
        return sum(total for _, total in self.legend)


def nice_ceiling(value: int) -> int:
    """The smallest of 1, 2 or 5 times a power of ten at or above `value` (at least 1)."""
    if value <= 1:
        return 1
    magnitude = 1
    while magnitude * 10 <= value:
        magnitude *= 10
    for step in (1, 2, 5, 10):
        if step * magnitude >= value:
            return step * magnitude
    return 10 * magnitude  # pragma: no cover (the loop always returns)


def stacked_bars(
    *,
    title: str,
    buckets: Sequence[str],
    series: Sequence[Series],
    tick_every: int,
    width: int = 640,
    height: int = 180,
) -> BarChart:
    """One bar per bucket, its series stacked bottom-up in the order given.

    A zero count draws no rectangle; every drawn rectangle carries its series,
    bucket label and count (`data-*` attributes and a tooltip in the template).
    """
    for one in series:
        if len(one.counts) != len(buckets):
            raise ValueError(f"series {one.name} has {len(one.counts)} counts for {len(buckets)}")
    plot_w = width - _LEFT - _RIGHT
    plot_h = height - _TOP - _BOTTOM
    baseline = _TOP + plot_h
    totals = [sum(one.counts[i] for one in series) for i in range(len(buckets))]
    peak = nice_ceiling(max(totals, default=0))
    slot = plot_w / max(len(buckets), 1)
    bar_w = max(slot * 0.8, 1.0)
    rects: list[Rect] = []
    for i, label in enumerate(buckets):
        x = _LEFT + i * slot + (slot - bar_w) / 2
        top = float(baseline)
        for one in series:
            count = one.counts[i]
            if count <= 0:
                continue
            h = plot_h * count / peak
            top -= h
            rects.append(
                Rect(
                    x=_f(x),
                    y=_f(top),
                    width=_f(bar_w),
                    height=_f(h),
                    series=one.name,
                    bucket=label,
                    count=count,
                )
            )
    ticks = tuple(
        Tick(x=_f(_LEFT + i * slot + slot / 2), label=label)
        for i, label in enumerate(buckets)
        if i % tick_every == 0
    )
    grid = tuple(
        GridLine(y=_f(baseline - plot_h * fraction), label=str(round(peak * fraction)))
        for fraction in (0.0, 0.5, 1.0)
        if fraction == 0.0 or peak * fraction == int(peak * fraction)
    )
    return BarChart(
        title=title,
        width=width,
        height=height,
        left=_f(_LEFT),
        right=_f(width - _RIGHT),
        baseline=_f(baseline),
        rects=tuple(rects),
        ticks=ticks,
        grid=grid,
        legend=tuple((one.name, sum(one.counts)) for one in series),
        peak=peak,
    )
