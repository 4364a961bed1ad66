"""The HTML report (inline SVG, self-contained), the PNG rasteriser and the chart layout."""

from __future__ import annotations

import random
import re
import struct
import zlib
from html.parser import HTMLParser
from xml.etree import ElementTree

import pytest

from loadgen.charts import (
    charts_for,
    format_tick,
    histogram_chart,
    latency_chart,
    log_ticks,
    nice_ticks,
)
from loadgen.png import PNG_SIGNATURE, Canvas, encode_png, hex_color, png_report
from loadgen.recorder import Recorder
from loadgen.report import html_report, svg_chart
from loadgen.result import LoadResult

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


def test_html_report_has_the_charts_and_fetches_nothing() -> None:
    page = html_report(synthetic(), config={"url": URL, "rate": "400/s"})
    parser = _Collector()
    parser.feed(page)
    assert parser.tags.count("svg") == 3
    assert "polyline" in parser.tags and "rect" in parser.tags
    for tag in ("script", "link", "img", "iframe", "object", "embed", "audio", "video"):
        assert tag not in parser.tags
    names = {name for name, _ in parser.attrs}
    assert not names & {"src", "href", "srcset", "xlink:href", "action"}
    assert "url(" not in page and "@import" not in page
    assert "<b>" not in page and "q=&lt;b&gt;&amp;x=1" in page  # escaped
    for text in ("Latency over time", "Latency histogram", "Throughput over time", "503"):
        assert text in page
    assert "RequestTimeout" in page and "intended send" in page and "p99.9" in page


def test_each_svg_is_well_formed_xml() -> None:
    for chart in charts_for(synthetic()):
        root = ElementTree.fromstring(svg_chart(chart))
        assert root.tag == "{http://www.w3.org/2000/svg}svg"


def test_a_run_without_successes_still_renders() -> None:
    res = synthetic(mode="closed", ok=0)
    page = html_report(res)
    assert page.count("<svg") == 3 and "no successful responses" in page
    assert png_report(res).startswith(PNG_SIGNATURE)


def test_charts_leave_out_the_drain_after_the_window() -> None:
    res = synthetic()
    assert len(res.timeline) == 6 and res.window_s == 5.0
    chart = latency_chart(res)
    assert [round(x, 1) for x, _ in chart.lines[0].points] == [0.5, 1.5, 2.5, 3.5, 4.5]
    p50 = [y for _, y in chart.lines[0].points]
    p99 = [y for _, y in chart.lines[1].points]
    assert all(a <= b for a, b in zip(p50, p99, strict=True))
    assert p99[-1] > p99[0]  # latency grew over the run
    hist = histogram_chart(res)
    assert sum(b.height for b in hist.bars) == res.ok
    assert [s.label.split()[0] for s in hist.lines] == ["p50", "p99"]


def _chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    assert png[:8] == PNG_SIGNATURE
    pos, out = 8, []
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        tag, data = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", png[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(tag + data) & 0xFFFFFFFF
        out.append((tag, data))
        pos += 12 + length
    return out


def test_png_report_is_a_valid_png() -> None:
    png = png_report(synthetic())
    chunks = _chunks(png)
    assert [t for t, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, color, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (width, height) == (760, 840)
    assert (depth, color, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[1][1])
    stride = 1 + width * 3
    assert len(raw) == stride * height
    assert all(raw[y * stride] == 0 for y in range(height))  # filter type "none"
    pixels = b"".join(raw[y * stride + 1 : (y + 1) * stride] for y in range(height))
    colors = {pixels[i : i + 3] for i in range(0, len(pixels), 3)}
    assert bytes(hex_color("#d62728")) in colors  # the P99 line
    assert bytes(hex_color("#4c72b0")) in colors  # histogram bars
    assert sum(1 for i in range(0, len(pixels), 3) if pixels[i : i + 3] != b"\xff\xff\xff") > 5000


def test_canvas_primitives() -> None:
    c = Canvas(20, 10)
    red = (255, 0, 0)
    c.line(0, 0, 19, 9, red)
    assert c.get(0, 0) == red and c.get(19, 9) == red
    c.line(-50, 5, 50, 5, red, width=3)  # clipped, thick
    assert c.get(10, 4) == c.get(10, 6) == red
    c.fill_rect(15, -5, 40, 3, (0, 0, 255))
    assert c.get(19, 0) == (0, 0, 255) and c.get(14, 0) != (0, 0, 255)
    blank = Canvas(8, 8)
    blank.text(1, 0, " ")
    assert set(blank.pixels) == {255}
    blank.text(1, 0, "0")
    assert blank.get(2, 0) == (34, 34, 34)  # top row of "0" is .###.
    png = encode_png(c.width, c.height, c.pixels)
    assert png.startswith(PNG_SIGNATURE)
    with pytest.raises(ValueError):
        encode_png(2, 2, b"\x00" * 11)


def test_ticks_and_labels() -> None:
    assert nice_ticks(0, 87) == [0, 20, 40, 60, 80, 100]
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 0) == nice_ticks(0, 1)  # an empty range becomes [0, 1]
    assert log_ticks(0.5, 30) == [0.5, 1, 2, 5, 10, 20]
    assert log_ticks(1.1, 1.9) == pytest.approx([1.1, (1.1 * 1.9) ** 0.5, 1.9])
    assert [format_tick(v) for v in (0, 0.25, 12, 1500, 20000, 2.5e6)] == [
        "0",
        "0.25",
        "12",
        "1500",
        "20k",
        "2.5M",
    ]
    assert re.fullmatch(r"\d+(\.\d+)?", format_tick(99.5))
