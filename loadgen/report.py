"""A self-contained HTML report of one run: summary tables and inline SVG charts.

Nothing is fetched when the page is opened: no scripts, no stylesheets, fonts or images by URL;
the charts are ``<svg>`` elements written into the page (:func:`svg_chart`).
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Mapping
from typing import Any

from loadgen.charts import COLORS, Chart, charts_for, format_tick
from loadgen.result import PERCENTILES, LoadResult

__all__ = ["html_report", "svg_chart"]

WIDTH = 760
HEIGHT = 280

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 800px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
code { background: #f4f4f4; padding: 0 .2em; }
.note { color: #666; font-size: .9em; }
svg { display: block; margin: .8em 0; }
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _f(x: float) -> str:
    return f"{x:.1f}"


def svg_chart(chart: Chart, width: int = WIDTH, height: int = HEIGHT) -> str:
    """One chart as an inline ``<svg>`` element."""
    left, top, right, bottom = chart.plot_box(width, height)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{_e(chart.title)}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{left}" y="18" font-size="13" font-weight="bold">{_e(chart.title)}</text>',
    ]
    for y in chart.y_ticks:
        _, py = chart.to_px(chart.x_range[0], y, width, height)
        out.append(
            f'<line x1="{left}" y1="{_f(py)}" x2="{right}" y2="{_f(py)}" '
            f'stroke="{COLORS["grid"]}"/>'
        )
        out.append(
            f'<text x="{left - 6}" y="{_f(py + 4)}" text-anchor="end">{_e(format_tick(y))}</text>'
        )
    for x in chart.x_ticks:
        px, _ = chart.to_px(x, chart.y_range[0], width, height)
        out.append(
            f'<line x1="{_f(px)}" y1="{bottom}" x2="{_f(px)}" y2="{bottom + 5}" '
            f'stroke="{COLORS["axis"]}"/>'
        )
        out.append(
            f'<text x="{_f(px)}" y="{bottom + 17}" text-anchor="middle">{_e(format_tick(x))}</text>'
        )
    for bar in chart.bars:
        x0, y0 = chart.to_px(bar.x0, bar.height, width, height)
        x1, _ = chart.to_px(bar.x1, 0.0, width, height)
        out.append(
            f'<rect x="{_f(x0)}" y="{_f(y0)}" width="{_f(max(x1 - x0 - 0.5, 0.5))}" '
            f'height="{_f(bottom - y0)}" fill="{chart.bar_color}"/>'
        )
    for series in chart.lines:
        if not series.points:
            continue
        pts = " ".join(
            f"{_f(px)},{_f(py)}"
            for px, py in (chart.to_px(x, y, width, height) for x, y in series.points)
        )
        dash = ' stroke-dasharray="5,4"' if series.dashed else ""
        if len(series.points) == 1:
            px, py = chart.to_px(*series.points[0], width, height)
            out.append(f'<circle cx="{_f(px)}" cy="{_f(py)}" r="2.5" fill="{series.color}"/>')
        else:
            out.append(
                f'<polyline points="{pts}" fill="none" stroke="{series.color}" '
                f'stroke-width="1.8"{dash}/>'
            )
    out.append(
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="{COLORS["axis"]}"/>'
    )
    out.append(
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="{COLORS["axis"]}"/>'
    )
    out.append(
        f'<text x="{(left + right) / 2:.0f}" y="{height - 6}" text-anchor="middle">'
        f"{_e(chart.x_label)}</text>"
    )
    out.append(
        f'<text x="14" y="{(top + bottom) / 2:.0f}" text-anchor="middle" '
        f'transform="rotate(-90 14 {(top + bottom) / 2:.0f})">{_e(chart.y_label)}</text>'
    )
    lx = right - 150
    shown = [s for s in chart.lines if s.points]
    if shown:  # a white box, so the legend stays legible over the lines
        out.append(
            f'<rect x="{lx - 6}" y="{top + 1}" width="{right - lx + 4}" '
            f'height="{15 * len(shown) + 6}" fill="#ffffff" fill-opacity="0.85"/>'
        )
    for i, series in enumerate(shown):
        ly = top + 12 + 15 * i
        out.append(
            f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 18}" y2="{ly - 4}" stroke="{series.color}" '
            'stroke-width="2"/>'
        )
        out.append(f'<text x="{lx + 24}" y="{ly}">{_e(series.label)}</text>')
    if chart.empty_note:
        out.append(
            f'<text x="{(left + right) / 2:.0f}" y="{(top + bottom) / 2:.0f}" '
            f'text-anchor="middle" fill="#888">{_e(chart.empty_note)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _latency_rows(result: LoadResult) -> list[tuple[str, Mapping[str, float | None]]]:
    label = "latency (from intended send)" if result.mode == "open" else "latency"
    rows: list[tuple[str, Mapping[str, float | None]]] = [(label, result.latency_ms)]
    if result.service_ms is not None:
        rows.append(("service time (from actual send)", result.service_ms))
    return rows


def html_report(
    result: LoadResult, *, title: str = "inferq loadgen", config: Mapping[str, Any] | None = None
) -> str:
    """The whole report page as a string."""
    keys = [*PERCENTILES, "max", "mean"]
    lat_head = "".join(f"<th>{_e(k)}</th>" for k in keys)
    lat_rows = "".join(
        f"<tr><td>{_e(name)}</td>" + "".join(f"<td>{_ms(v.get(k))}</td>" for k in keys) + "</tr>"
        for name, v in _latency_rows(result)
    )
    counts = "".join(
        f"<tr><td>{_e(k)}</td><td>{v:,}</td></tr>"
        for k, v in [
            *((str(s), n) for s, n in result.status_counts.items()),
            *result.stats.exceptions.items(),
        ]
    )
    overview = [
        ("mode", result.mode),
        ("URL", result.url),
        ("concurrency" if result.mode != "open" else "connections (peak)", result.concurrency),
    ]
    if result.mode == "open":
        overview.append(("schedule", result.schedule or "-"))
        overview.append(
            ("target req/s", "-" if result.target_rps is None else f"{result.target_rps:,.1f}")
        )
    overview += [
        ("measured", f"{result.duration_s:.2f} s ({result.warmup_requests:,} warm-up requests)"),
        ("requests", f"{result.requests:,} ({result.ok:,} 2xx, {result.error_count:,} other)"),
        ("throughput", f"{result.throughput_rps:,.1f} req/s ({result.ok_rps:,.1f} 2xx/s)"),
        ("client CPU", f"{result.client_cpu_share:.0%} of one core"),
    ]
    if result.send_lag_ms and result.send_lag_ms.get("p99") is not None:
        overview.append(("send lag p99", f"{result.send_lag_ms['p99']:.3f} ms"))
    jobs = result.extra.get("jobs")
    if jobs:
        overview.append(
            ("jobs", f"{jobs['submitted']:,} submitted, {jobs['polls_per_job']:.2f} polls/job")
        )
    over = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in overview)
    charts = "\n".join(svg_chart(c) for c in charts_for(result))
    cfg = ""
    if config:
        cfg_rows = "".join(
            f"<tr><td>{_e(k)}</td><td><code>{_e(v)}</code></td></tr>"
            for k, v in config.items()
            if v is not None
        )
        cfg = f"<h2>Configuration</h2><table>{cfg_rows}</table>"
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    note = ""
    if result.mode == "open":
        note = (
            '<p class="note">Open loop: latency counts from each request\'s intended send '
            "time (Poisson arrivals), so waiting caused by a slow server is included "
            "(no coordinated omission); service time counts from the actual write.</p>"
        )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{_e(title)}: {_e(result.url)}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>{_e(title)}</h1>
<table>{over}</table>
<h2>Latency (ms, 2xx responses)</h2>
<table><tr><th></th>{lat_head}</tr>{lat_rows}</table>
{note}
<h2>Responses by status</h2>
<table><tr><th>status</th><th>count</th></tr>{counts}</table>
<h2>Charts</h2>
{charts}
{cfg}
<p class="note">Generated {now} by inferq loadgen. Percentiles from an HdrHistogram, within 0.1 %.</p>
</body>
</html>
"""
