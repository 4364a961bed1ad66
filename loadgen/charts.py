"""The run's three charts, drawn with matplotlib: the optional extra ``inferq[charts]``.

Latency over time (P50 and P99 per second), throughput over time (2xx and errors per second), and
the latency histogram (log-spaced bins from the HDR buckets, with P50/P99 markers). The same
drawing serves both outputs: :func:`png_report` stacks the three in one PNG (``--png``) and
:func:`svg_charts` gives each as an inline ``<svg>`` for the HTML report.

matplotlib is imported only here and only when a chart is drawn, so loadgen runs without it:
:func:`available` says whether it is installed, and :data:`INSTALL_HINT` what to do if not.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loadgen.recorder import TimelineRow
from loadgen.result import LoadResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["INSTALL_HINT", "available", "png_report", "svg_charts"]

INSTALL_HINT = "charts need matplotlib: pip install 'inferq[charts]'"
COLORS = {"p50": "#1f77b4", "p99": "#d62728", "ok": "#2ca02c", "errors": "#d62728"}
HISTOGRAM_BINS = 60
#: One chart's size in inches at :data:`DPI`: 760 x 280 pixels.
CHART_SIZE = (7.6, 2.8)
DPI = 100
#: Deterministic SVG: no date, element ids from a fixed salt (reports diff cleanly).
_SVG_RC: dict[str, Any] = {"svg.fonttype": "none", "svg.hashsalt": "inferq-loadgen"}


def available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _window_rows(result: LoadResult) -> list[TimelineRow]:
    """Timeline rows that start inside the measurement window (not the drain after it)."""
    if result.window_s is None:
        return list(result.timeline)
    return [r for r in result.timeline if r.t < result.window_s - 1e-9]


def _empty(ax: Axes, note: str) -> None:
    ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", color="#888888")


def latency_over_time(ax: Axes, result: LoadResult) -> None:
    rows = _window_rows(result)
    ax.set_title("Latency over time: P50 and P99 per second (2xx, ms)", loc="left")
    for key in ("p50", "p99"):
        points = [(r.t + 0.5, getattr(r, f"{key}_ms")) for r in rows]
        xs = [x for x, y in points if y is not None]
        ax.plot(xs, [y for _, y in points if y is not None], color=COLORS[key], label=key)
    if not any(r.p50_ms is not None for r in rows):
        _empty(ax, "no successful responses")
    else:
        ax.legend(loc="best")
    ax.set_xlabel("seconds into measurement")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)


def throughput_over_time(ax: Axes, result: LoadResult) -> None:
    rows = _window_rows(result)
    ax.set_title("Throughput over time: completions per second", loc="left")
    xs = [r.t + 0.5 for r in rows]
    ax.plot(xs, [r.ok for r in rows], color=COLORS["ok"], label="2xx/s")
    if any(r.errors for r in rows):
        ax.plot(xs, [r.errors for r in rows], color=COLORS["errors"], label="errors/s")
    if rows:
        ax.legend(loc="best")
    else:
        _empty(ax, "nothing completed")
    ax.set_xlabel("seconds into measurement")
    ax.set_ylabel("req/s")
    ax.set_ylim(bottom=0)


def latency_histogram(ax: Axes, result: LoadResult) -> None:
    ax.set_title("Latency histogram (2xx, ms, log scale)", loc="left")
    ax.set_xscale("log")
    ax.set_xlabel("ms")
    ax.set_ylabel("requests")
    buckets = result.histogram()
    if not buckets:
        _empty(ax, "no successful responses")
        return
    lo = max(buckets[0][0], 1e-3)
    hi = max(buckets[-1][1], lo * 1.01)
    edges = [lo * (hi / lo) ** (i / HISTOGRAM_BINS) for i in range(HISTOGRAM_BINS + 1)]
    # Each HDR bucket (far finer than a bin) counts at its geometric middle.
    middles = [min(max(math.sqrt(max(b_lo, 1e-3) * b_hi), lo), hi) for b_lo, b_hi, _ in buckets]
    ax.hist(middles, bins=edges, weights=[c for _, _, c in buckets], color="#4c72b0")
    for key in ("p50", "p99"):
        value = result.latency_ms.get(key)
        if value is not None:
            label = f"{key} {value:.3g} ms"
            ax.axvline(value, color=COLORS[key], linestyle="--", label=label)
    ax.legend(loc="best")


Drawing = Callable[["Axes", LoadResult], None]
CHARTS: tuple[Drawing, ...] = (latency_over_time, throughput_over_time, latency_histogram)


def _figure(rows: int) -> Figure:
    # The Figure class, not pyplot: no global state and no GUI backend is ever touched.
    from matplotlib.figure import Figure

    width, height = CHART_SIZE
    return Figure(figsize=(width, height * rows), dpi=DPI, layout="constrained")


def _save(fig: Figure, fmt: str) -> bytes:
    import matplotlib

    buf = io.BytesIO()
    with matplotlib.rc_context(_SVG_RC):  # type: ignore[arg-type]  # (keys are Literals)
        fig.savefig(buf, format=fmt, metadata={"Date": None} if fmt == "svg" else None)
    return buf.getvalue()


def png_report(result: LoadResult) -> bytes:
    """The three charts stacked in one PNG (760 x 840 pixels)."""
    fig = _figure(len(CHARTS))
    for ax, draw in zip(fig.subplots(len(CHARTS), 1), CHARTS, strict=True):
        ax.grid(alpha=0.3)
        draw(ax, result)
    return _save(fig, "png")


def svg_charts(result: LoadResult) -> list[str]:
    """Each chart as an ``<svg>`` element to write into an HTML page (no XML prologue)."""
    out = []
    for draw in CHARTS:
        fig = _figure(1)
        ax = fig.subplots()
        ax.grid(alpha=0.3)
        draw(ax, result)
        text = _save(fig, "svg").decode("utf-8")
        out.append(re.sub(r"^.*?(?=<svg)", "", text, flags=re.DOTALL))
    return out
