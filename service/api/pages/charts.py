"""Charts as numbers for inline SVG: where each point, bar, tick and label goes.

The server draws the charts (``templates/_charts.html`` writes the SVG elements), so they need no
script, load nothing and read the same in every browser; each point carries its version and value
in an SVG ``<title>``, which browsers show on hover. Nothing here knows HTML or escapes text.
Coordinates are in the SVG's own units (its ``viewBox``); CSS scales the picture to the page.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ckptstore.service.api.pages.formatting import human_size
from ckptstore.service.api.pages.numbers import NumberFormat
from ckptstore.service.format.names import metric_to_json

WIDTH, HEIGHT = 480, 210
#: A point to draw: (x: a step or version number, y, the version it stands for, hover text).
Point = tuple[float, float, int, str]
LEFT, RIGHT, TOP, BOTTOM = 62, 14, 12, 34


@dataclass(frozen=True)
class Tick:
    """An axis mark: its position along the axis (SVG units) and its label."""

    at: float
    label: str


@dataclass(frozen=True)
class Mark:
    """A point of a line chart: where it is drawn, the version it stands for and its hover text."""

    x: float
    y: float
    version: int
    label: str


@dataclass(frozen=True)
class Line:
    """One series of a chart that draws several (a run on the compare page): its name, the number
    of its colour, its marks and the polyline through them."""

    name: str
    index: int
    marks: list[Mark]
    points: str


@dataclass(frozen=True)
class Bar:
    """One version's stacked bar: new bytes at the bottom, shared bytes above."""

    x: float
    width: float
    new_top: float
    shared_top: float
    version: int
    label: str


@dataclass(frozen=True)
class Chart:
    """A chart ready to draw: its marks or bars, its axes and the polyline through the marks."""

    title: str
    x_label: str
    x_ticks: list[Tick]
    y_ticks: list[Tick]
    marks: list[Mark]
    bars: list[Bar]
    line: str
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    top: int = TOP
    lines: list[Line] = field(default_factory=list)
    #: Points not drawn because their value is NaN or infinite, as "v7 NaN" (a diverging run).
    left_out: list[str] = field(default_factory=list)

    @property
    def right(self) -> int:
        """The plot area's right edge."""
        return self.width - RIGHT

    @property
    def bottom(self) -> int:
        """The plot area's bottom edge (the x axis)."""
        return self.height - BOTTOM


def nice_ticks(low: float, high: float, count: int = 5, *, integer: bool = False) -> list[float]:
    """About ``count`` round values (steps of 1, 2, 2.5 or 5 times a power of ten) covering ``low``..``high``.

    With ``integer`` (a step or version axis) every tick is a whole number: steps of at least 1,
    and never 2.5 where that would give halves (7.5, 12.5).
    """
    if not (math.isfinite(low) and math.isfinite(high)) or high < low:
        return []
    if high == low:
        return [float(round(low))] if integer else [low]
    if integer:
        low, high = math.ceil(low), math.floor(high)
        if high <= low:
            return [float(low)] if high == low else []
    raw = (high - low) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    steps = (m * power for m in (1, 2, 2.5, 5, 10))
    step = next(s for s in steps if s >= raw and (not integer or (s >= 1 and float(s).is_integer())))
    first = math.ceil(low / step - 1e-9)
    ticks: list[float] = []
    index = first
    while index * step <= high + step * 1e-9 and len(ticks) < 4 * count:
        ticks.append(round(index * step, 12))
        index += 1
    return ticks


def byte_ticks(top: int, count: int = 4) -> list[int]:
    """Round byte counts from 0 covering ``top``, in steps of a round number of B, KiB, MiB, …"""
    unit = 1
    while top / unit >= 1024:
        unit *= 1024
    steps = nice_ticks(0, top / unit, count)
    ticks = [int(v * unit) for v in steps]
    if ticks[-1] < top:  # one more step, so the highest bar sits under the top line
        ticks.append(int((steps[-1] + (steps[1] - steps[0] if len(steps) > 1 else steps[-1] or 1)) * unit))
    return list(dict.fromkeys(ticks))


def _scale(low: float, high: float, start: float, end: float) -> Callable[[float], float]:
    """Map low..high onto start..end (the middle when the range is a single value)."""
    if high == low:
        return lambda value: round((start + end) / 2, 1)
    ratio = (end - start) / (high - low)
    return lambda value: round(start + (value - low) * ratio, 1)


def _padded(values: Sequence[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    if low == high:
        spread = abs(low) * 0.1 or 1.0
        return low - spread, high + spread
    margin = (high - low) * 0.05
    return low - margin, high + margin


Axis = tuple[float, float, Callable[[float], float]]


def _ticks(x: Axis, y: Axis) -> tuple[list[Tick], list[Tick]]:
    """Ticks of a step (or version) axis and a value axis, each (low, high, position of a value).

    The x axis counts steps or versions, so its ticks are whole numbers (never 7.5); the y axis
    writes every tick in one notation (never 5e-05 beside 0.0001).
    """
    x_low, x_high, to_x = x
    y_low, y_high, to_y = y
    x_ticks = [Tick(to_x(v), f"{int(v):,}") for v in nice_ticks(x_low, x_high, integer=True)]
    y_values = [v for v in nice_ticks(y_low, y_high) if y_low <= v <= y_high]
    y_format = NumberFormat.of(y_values)
    return x_ticks, [Tick(to_y(v), y_format(v)) for v in y_values]


def _not_finite(points: Sequence[Point]) -> list[str]:
    """The points whose value cannot be drawn (NaN, infinite), as "v7 NaN", by version."""
    return [f"v{p[2]} {metric_to_json(p[1])}" for p in sorted(points, key=lambda p: p[2]) if not math.isfinite(p[1])]


def _axes(
    chart: Chart, points: Sequence[Point]
) -> tuple[Callable[[float], float], Callable[[float], float], list[Tick], list[Tick]]:
    """``(to_x, to_y, x_ticks, y_ticks)`` of axes covering ``points`` (finite, at least one) on ``chart``."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_low, x_high = min(xs), max(xs)
    y_low, y_high = _padded(ys)
    to_x = _scale(x_low, x_high, chart.left + 4, chart.right - 4)
    to_y = _scale(y_low, y_high, chart.bottom, chart.top)
    x_ticks, y_ticks = _ticks((x_low, x_high, to_x), (y_low, y_high, to_y))
    return to_x, to_y, x_ticks, y_ticks


def line_chart(title: str, points: Sequence[Point], x_label: str) -> Chart:
    """A line through ``points`` ((x, y, version, hover text)), ordered by x then version; points
    whose value is NaN or infinite are not drawn but listed in ``left_out``."""
    left_out = _not_finite(points)
    ordered = sorted((p for p in points if math.isfinite(p[1])), key=lambda p: (p[0], p[2]))
    chart = Chart(title, x_label, [], [], [], [], "", left_out=left_out)
    if not ordered:
        return chart
    to_x, to_y, x_ticks, y_ticks = _axes(chart, ordered)
    marks = [Mark(to_x(x), to_y(y), version, label) for x, y, version, label in ordered]
    line = " ".join(f"{m.x},{m.y}" for m in marks)
    return Chart(title, x_label, x_ticks, y_ticks, marks, [], line, left_out=left_out)


def series_chart(title: str, series: Sequence[tuple[str, int, Sequence[Point]]], x_label: str) -> Chart:
    """Several lines on one pair of axes: ``series`` is (name, colour number, points) per line,
    each line's points ordered by x then version; the axes cover every line. Points whose value is
    NaN or infinite are not drawn but listed in ``left_out`` (with their line's name)."""
    left_out = [f"{name} {text}" for name, _, points in series for text in _not_finite(points)]
    series = [(name, index, [p for p in points if math.isfinite(p[1])]) for name, index, points in series]
    chart = Chart(title, x_label, [], [], [], [], "", left_out=left_out)
    every = [p for _, _, points in series for p in points]
    if not every:
        return chart
    to_x, to_y, x_ticks, y_ticks = _axes(chart, every)
    lines = []
    for name, index, points in series:
        ordered = sorted(points, key=lambda p: (p[0], p[2]))
        marks = [Mark(to_x(x), to_y(y), version, label) for x, y, version, label in ordered]
        lines.append(Line(name, index, marks, " ".join(f"{m.x},{m.y}" for m in marks)))
    return Chart(title, x_label, x_ticks, y_ticks, [], [], "", lines=lines, left_out=left_out)


def storage_chart(title: str, rows: Sequence[tuple[int, int, int]]) -> Chart:
    """Stacked bars of (version, new bytes, logical bytes) in version order, on a byte axis from 0."""
    chart = Chart(title, "version", [], [], [], [], "")
    if not rows:
        return chart
    versions = [version for version, _, _ in rows]
    top_bytes = max(max(total for _, _, total in rows), 1)
    ticks = byte_ticks(top_bytes)
    ceiling = max(top_bytes, ticks[-1])
    to_y = _scale(0, ceiling, chart.bottom, chart.top)
    span = (chart.right - chart.left) / len(rows)
    width = round(max(0.6, span * 0.8), 2)
    bars = []
    for index, (version, new, total) in enumerate(rows):
        x = round(chart.left + index * span + (span - width) / 2, 1)
        label = f"v{version} · {human_size(total)} in all: {human_size(new)} new, {human_size(total - new)} shared"
        bars.append(Bar(x, width, to_y(new), to_y(total), version, label))
    every = max(1, math.ceil(len(rows) / 6))
    x_ticks = [Tick(round(chart.left + (i + 0.5) * span, 1), f"v{versions[i]}") for i in range(0, len(rows), every)]
    y_ticks = [Tick(to_y(v), human_size(int(v))) for v in ticks]
    return Chart(title, "version", x_ticks, y_ticks, [], bars, "")
