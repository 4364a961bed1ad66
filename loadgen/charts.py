"""Chart descriptions shared by the HTML (SVG) and PNG renderers: what to draw, not how.

:func:`charts_for` turns a :class:`~loadgen.result.LoadResult` into three :class:`Chart`\\ s:
latency over time (P50 and P99 per second), throughput over time (2xx and errors per second),
and the latency histogram (log-spaced bins, with P50/P99 markers).  A chart maps data to a box
in pixels with :meth:`Chart.to_px`; both renderers use the same layout constants, so the PNG
and the SVG of one run look alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loadgen.recorder import TimelineRow
from loadgen.result import LoadResult

__all__ = [
    "MARGIN",
    "Bar",
    "Chart",
    "Series",
    "charts_for",
    "format_tick",
    "histogram_chart",
    "latency_chart",
    "log_ticks",
    "nice_ticks",
    "throughput_chart",
]

#: (left, top, right, bottom) margins of a chart's plot area inside its box, in pixels.
MARGIN = (64, 30, 18, 40)
COLORS = {
    "p50": "#1f77b4",
    "p99": "#d62728",
    "ok": "#2ca02c",
    "errors": "#d62728",
    "bars": "#4c72b0",
    "grid": "#e5e5e5",
    "axis": "#333333",
}
HISTOGRAM_BINS = 60


@dataclass
class Series:
    label: str
    color: str
    points: list[tuple[float, float]]
    dashed: bool = False


@dataclass
class Bar:
    x0: float
    x1: float
    height: float


@dataclass
class Chart:
    title: str
    x_label: str
    y_label: str
    x_range: tuple[float, float]
    y_range: tuple[float, float]
    x_ticks: list[float]
    y_ticks: list[float]
    x_log: bool = False
    lines: list[Series] = field(default_factory=list)
    bars: list[Bar] = field(default_factory=list)
    bar_color: str = COLORS["bars"]
    empty_note: str | None = None

    def plot_box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(left, top, right, bottom) of the plot area in a ``width`` x ``height`` box."""
        left, top, right, bottom = MARGIN
        return left, top, width - right, height - bottom

    def _frac_x(self, x: float) -> float:
        lo, hi = self.x_range
        if self.x_log:
            x, lo, hi = math.log10(max(x, 1e-12)), math.log10(lo), math.log10(hi)
        return 0.0 if hi == lo else (x - lo) / (hi - lo)

    def to_px(self, x: float, y: float, width: int, height: int) -> tuple[float, float]:
        """Data coordinates to pixels in a ``width`` x ``height`` box (y grows downwards)."""
        left, top, right, bottom = self.plot_box(width, height)
        lo, hi = self.y_range
        fy = 0.0 if hi == lo else (y - lo) / (hi - lo)
        return left + self._frac_x(x) * (right - left), bottom - fy * (bottom - top)


def nice_step(span: float, count: int = 5) -> float:
    """A 1-2-5 step that cuts ``span`` into about ``count`` intervals."""
    if not span > 0:
        return 1.0
    raw = span / count
    magnitude = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * magnitude >= raw * 0.999:
            return m * magnitude
    return 10 * magnitude


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (``hi`` is rounded up to a tick)."""
    if not hi > lo:
        hi = lo + 1.0
    step = nice_step(hi - lo, count)
    start = math.floor(lo / step + 1e-9) * step
    ticks: list[float] = []
    v = start
    while v <= hi + step * 0.999 and len(ticks) < 50:
        ticks.append(round(v, 12))
        if v >= hi - 1e-12:
            break
        v += step
    return ticks


def log_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks per decade within [lo, hi]: just the decades when that is too many, more
    steps (1-1.5-2-3-...) when the range is narrow."""

    def ticks_with(steps: tuple[float, ...]) -> list[float]:
        out = []
        for exp in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
            for m in steps:
                v = round(m * 10.0**exp, 12)
                if lo * 0.999 <= v <= hi * 1.001:
                    out.append(v)
        return out

    ticks = ticks_with((1, 2, 5))
    if len(ticks) < 4:
        ticks = ticks_with((1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9))
        if len(ticks) > 8:
            ticks = [
                v for v in ticks if round(v / 10 ** math.floor(math.log10(v)), 6) in (1, 2, 3, 5, 7)
            ]
    if len(ticks) > 10:
        ticks = [v for v in ticks if round(v / 10 ** math.floor(math.log10(v))) == 1]
    if len(ticks) < 2:  # a range narrower than 1-2-5 steps: its ends and geometric middle
        ticks = [lo, math.sqrt(lo * hi), hi]
    return ticks


def format_tick(v: float) -> str:
    """Short labels: ``0``, ``0.25``, ``12``, ``1.5k``, ``20k``, ``1.2M``."""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:g}M"
    if a >= 1e4:
        return f"{v / 1e3:g}k"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def _padded_max(values: list[float]) -> float:
    top = max(values, default=0.0)
    return top * 1.05 if top > 0 else 1.0


def _window_rows(result: LoadResult) -> list[TimelineRow]:
    """Timeline rows that start inside the measurement window (not the drain after it)."""
    if result.window_s is None:
        return list(result.timeline)
    return [r for r in result.timeline if r.t < result.window_s - 1e-9]


def latency_chart(result: LoadResult) -> Chart:
    rows = _window_rows(result)
    p50 = [(r.t + 0.5, r.p50_ms) for r in rows if r.p50_ms is not None]
    p99 = [(r.t + 0.5, r.p99_ms) for r in rows if r.p99_ms is not None]
    return _over_time(
        "Latency over time: P50 and P99 per second (2xx, ms)",
        "ms",
        len(rows),
        [Series("p50", COLORS["p50"], p50), Series("p99", COLORS["p99"], p99)],
        None if p50 else "no successful responses",
    )


def throughput_chart(result: LoadResult) -> Chart:
    rows = _window_rows(result)
    ok = [(r.t + 0.5, float(r.ok)) for r in rows]
    errors = [(r.t + 0.5, float(r.errors)) for r in rows]
    lines = [Series("2xx/s", COLORS["ok"], ok)]
    if any(y for _, y in errors):
        lines.append(Series("errors/s", COLORS["errors"], errors))
    return _over_time(
        "Throughput over time: completions per second",
        "req/s",
        len(rows),
        lines,
        None if rows else "nothing completed",
    )


def _over_time(
    title: str, y_label: str, seconds: int, lines: list[Series], empty_note: str | None
) -> Chart:
    """A chart of per-second series over the measurement window."""
    x_ticks = nice_ticks(0.0, float(max(seconds, 1)), 8)
    y_ticks = nice_ticks(0.0, _padded_max([y for line in lines for _, y in line.points]))
    return Chart(
        title=title,
        x_label="seconds into measurement",
        y_label=y_label,
        x_range=(0.0, x_ticks[-1]),
        y_range=(0.0, y_ticks[-1]),
        x_ticks=x_ticks,
        y_ticks=y_ticks,
        lines=lines,
        empty_note=empty_note,
    )


def histogram_chart(result: LoadResult, bins: int = HISTOGRAM_BINS) -> Chart:
    buckets = result.histogram()
    if not buckets:
        return Chart(
            title="Latency histogram (2xx, ms, log scale)",
            x_label="ms",
            y_label="requests",
            x_range=(0.1, 10.0),
            y_range=(0.0, 1.0),
            x_ticks=log_ticks(0.1, 10.0),
            y_ticks=[0.0, 1.0],
            x_log=True,
            empty_note="no successful responses",
        )
    lo = max(buckets[0][0], 1e-3)
    hi = max(buckets[-1][1], lo * 1.01)
    lo_log, hi_log = math.log10(lo), math.log10(hi)
    width = (hi_log - lo_log) / bins
    counts = [0] * bins
    for b_lo, b_hi, c in buckets:
        mid = math.sqrt(max(b_lo, 1e-3) * b_hi)
        i = min(bins - 1, max(0, int((math.log10(mid) - lo_log) / width)))
        counts[i] += c
    bars = [
        Bar(10 ** (lo_log + i * width), 10 ** (lo_log + (i + 1) * width), float(c))
        for i, c in enumerate(counts)
        if c
    ]
    y_ticks = nice_ticks(0.0, _padded_max([b.height for b in bars]))
    top = y_ticks[-1]
    markers = []
    for key in ("p50", "p99"):
        value = result.latency_ms.get(key)
        if value is not None:
            points = [(value, 0.0), (value, top)]
            markers.append(Series(f"{key} {value:.3g} ms", COLORS[key], points, dashed=True))
    return Chart(
        title="Latency histogram (2xx, ms, log scale)",
        x_label="ms",
        y_label="requests",
        x_range=(lo, hi),
        y_range=(0.0, top),
        x_ticks=log_ticks(lo, hi),
        y_ticks=y_ticks,
        x_log=True,
        lines=markers,
        bars=bars,
    )


def charts_for(result: LoadResult) -> list[Chart]:
    return [latency_chart(result), throughput_chart(result), histogram_chart(result)]
