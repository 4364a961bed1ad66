"""A self-contained HTML report of one run: summary tables and inline SVG charts.

Nothing is fetched when the page is opened: no scripts, no stylesheets, fonts or images by URL;
the charts are ``<svg>`` elements written into the page by :mod:`loadgen.charts` when matplotlib
is installed (``inferq[charts]``); without it the page says so and keeps every table.
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Mapping
from typing import Any

from loadgen import charts as charts_module
from loadgen.result import PERCENTILES, LoadResult

__all__ = ["html_report"]

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
    if charts_module.available():
        charts = "\n".join(charts_module.svg_charts(result))
    else:
        charts = f'<p class="note">No charts: {_e(charts_module.INSTALL_HINT)}.</p>'

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
<p class="note">Generated {now} by inferq loadgen. Percentiles: HdrHistogram, within 0.1 %.</p>
</body>
</html>
"""
