"""The HTML report (tables always; inline SVG charts with matplotlib) and the PNG charts."""

from __future__ import annotations

import io
import random
import re
import sys
from html.parser import HTMLParser
from xml.etree import ElementTree

import pytest

from loadgen import charts
from loadgen.recorder import Recorder
from loadgen.report import html_report
from loadgen.result import LoadResult

needs_matplotlib = pytest.mark.skipif(
    not charts.available(), reason="matplotlib (the inferq[charts] extra) is not installed"
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

URL = "http://127.0.0.1:1/v2/models/m/infer?q=<b>&x=1"


def synthetic(mode: str = "open", ok: int = 2000) -> LoadResult:
    """A result recorded with made-up times: 5 s of measurement plus a drain."""
    rng = random.Random(1)
    rec = Recorder()
    rec.begin(0.0, 0.0, 5.0)
    for i in range(ok):
        end = i * 5.0 / max(ok, 1)
        latency = 0.002 + rng.expovariate(400) * (1 + end)  # slower towards the end
        rec.record(200, latency, end)
        rec.service.record(latency * 0.8)
        rec.send_lag.record(0.0002)
    rec.record(503, 0.001, 1.2)
    rec.record_error("RequestTimeout", 2.5)
    rec.record(200, 0.5, 5.6)  # completed in the drain, after the window
    return LoadResult.from_recorder(
        rec,
        mode=mode,
        url=URL,
        concurrency=8,
        duration_s=5.0,
        target_rps=400.0,
        offered_rps=401.0,
        schedule="400/s",
    )


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs.extend(attrs)


def _fragment_only(page: str) -> bool:
    """Every reference in the page points inside it (SVG clip paths, glyphs): nothing to fetch."""
    refs = re.findall(r"url\(([^)]*)\)", page)
    refs += re.findall(r'(?:href|src|srcset|action)="([^"]*)"', page)
    return all(ref.startswith("#") for ref in refs)


@needs_matplotlib
def test_html_report_has_the_charts_and_fetches_nothing() -> None:
    page = html_report(synthetic(), config={"url": URL, "rate": "400/s"})
    parser = _Collector()
    parser.feed(page)
    assert parser.tags.count("svg") == 3
    assert "path" in parser.tags
    for tag in ("script", "link", "img", "iframe", "object", "embed", "audio", "video"):
        assert tag not in parser.tags
    assert _fragment_only(page) and "@import" not in page
    assert "<b>" not in page and "q=&lt;b&gt;&amp;x=1" in page  # escaped
    for text in ("Latency over time", "Latency histogram", "Throughput over time", "503"):
        assert text in page
    assert "RequestTimeout" in page and "intended send" in page and "p99.9" in page


@needs_matplotlib
def test_each_svg_is_well_formed_xml() -> None:
    svgs = charts.svg_charts(synthetic())
    assert len(svgs) == 3
    for svg in svgs:
        root = ElementTree.fromstring(svg)
        assert root.tag == "{http://www.w3.org/2000/svg}svg"


def test_without_matplotlib_the_report_keeps_its_tables_and_says_how_to_get_charts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert not charts.available()
    page = html_report(synthetic())
    assert "<svg" not in page
    assert "pip install &#x27;inferq[charts]&#x27;" in page
    for text in ("p50", "p99.9", "503", "RequestTimeout", "throughput"):
        assert text in page


@needs_matplotlib
def test_a_run_without_successes_still_renders() -> None:
    res = synthetic(mode="closed", ok=0)
    page = html_report(res)
    assert page.count("<svg") == 3 and "no successful responses" in page
    assert charts.png_report(res).startswith(PNG_SIGNATURE)


@needs_matplotlib
def test_charts_leave_out_the_drain_after_the_window() -> None:
    from matplotlib.figure import Figure

    res = synthetic()
    assert len(res.timeline) == 6 and res.window_s == 5.0
    ax = Figure().subplots()
    charts.latency_over_time(ax, res)
    p50_line, p99_line = ax.get_lines()
    assert [round(x, 1) for x in p50_line.get_xdata()] == [0.5, 1.5, 2.5, 3.5, 4.5]
    p50, p99 = list(p50_line.get_ydata()), list(p99_line.get_ydata())
    assert all(a <= b for a, b in zip(p50, p99, strict=True))
    assert p99[-1] > p99[0]  # latency grew over the run
    ax = Figure().subplots()
    charts.latency_histogram(ax, res)
    assert sum(bar.get_height() for bar in ax.patches) == res.ok
    assert [line.get_label().split()[0] for line in ax.get_lines()] == ["p50", "p99"]


@needs_matplotlib
def test_png_report_stacks_the_three_charts() -> None:
    from PIL import Image  # matplotlib's own dependency

    png = charts.png_report(synthetic())
    assert png.startswith(PNG_SIGNATURE)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.size == (760, 840)
    colors = {color for _, color in image.getcolors(maxcolors=1 << 20)}
    assert (0xD6, 0x27, 0x28) in colors  # the P99 line
    assert (0x4C, 0x72, 0xB0) in colors  # histogram bars
