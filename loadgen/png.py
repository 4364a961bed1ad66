"""A tiny PNG rasteriser (zlib + struct, no imaging library) and the run's charts as a PNG.

:class:`Canvas` draws filled rectangles, lines (Bresenham, optionally thick or dashed) and 5x7
bitmap text (:mod:`loadgen.font`) into an RGB buffer; :func:`encode_png` writes it as an 8-bit
truecolor PNG (signature, IHDR, one zlib IDAT, IEND, CRCs).  :func:`png_report` stacks the
three charts of :func:`loadgen.charts.charts_for` into one image, with the same layout as the
HTML report's SVGs.
"""

from __future__ import annotations

import itertools
import struct
import zlib

from loadgen.charts import COLORS, Chart, charts_for, format_tick
from loadgen.font import GLYPH_HEIGHT, GLYPH_WIDTH, SPACING, glyph, text_width
from loadgen.result import LoadResult

__all__ = ["Canvas", "encode_png", "png_report", "render_chart"]

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (34, 34, 34)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WIDTH = 760
CHART_HEIGHT = 280


def hex_color(text: str) -> Color:
    """``"#1f77b4"`` as an (r, g, b) tuple."""
    text = text.lstrip("#")
    return int(text[0:2], 16), int(text[2:4], 16), int(text[4:6], 16)


def _chunk(tag: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(tag + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", crc)


def encode_png(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """An 8-bit RGB PNG of ``rgb`` (``width * height * 3`` bytes, rows top to bottom)."""
    stride = width * 3
    if len(rgb) != stride * height:
        raise ValueError(f"expected {stride * height} bytes of RGB data, got {len(rgb)}")
    # Filter type 0 (none) on every scanline.
    raw = b"".join(b"\x00" + bytes(rgb[y * stride : (y + 1) * stride]) for y in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        PNG_SIGNATURE
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(raw, 9))
        + _chunk(b"IEND", b"")
    )


class Canvas:
    """An RGB pixel buffer with a few drawing primitives; coordinates are clipped."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        if width < 1 or height < 1:
            raise ValueError("a canvas needs a positive size")
        self.width = width
        self.height = height
        self.pixels = bytearray(bytes(background) * (width * height))

    def get(self, x: int, y: int) -> Color:
        i = (y * self.width + x) * 3
        return self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]

    def point(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i : i + 3] = bytes(color)

    def fill_rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill [x0, x1) x [y0, y1)."""
        x0, x1 = max(0, min(x0, x1)), min(self.width, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height, max(y0, y1))
        if x0 >= x1 or y0 >= y1:
            return
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            i = (y * self.width + x0) * 3
            self.pixels[i : i + len(row)] = row

    def line(
        self,
        x0: float,
        y0: float,
        x1: float,
        y1: float,
        color: Color,
        width: int = 1,
        dash: int = 0,
    ) -> None:
        """A straight line; ``width`` > 1 draws a square brush, ``dash`` > 0 a dashed line."""
        ax, ay, bx, by = round(x0), round(y0), round(x1), round(y1)
        dx, dy = abs(bx - ax), -abs(by - ay)
        sx = 1 if ax < bx else -1
        sy = 1 if ay < by else -1
        err = dx + dy
        lo = -((width - 1) // 2)
        hi = lo + width
        step = 0
        for _ in range(dx - dy + 1):
            if not dash or (step // dash) % 2 == 0:
                if width == 1:
                    self.point(ax, ay, color)
                else:
                    self.fill_rect(ax + lo, ay + lo, ax + hi, ay + hi, color)
            step += 1
            if ax == bx and ay == by:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                ax += sx
            if e2 <= dx:
                err += dx
                ay += sy

    def text(self, x: int, y: int, text: str, color: Color = BLACK, scale: int = 1) -> None:
        """Draw ``text`` with its top-left corner at (x, y)."""
        for ch in text:
            rows = glyph(ch)
            for r, bits in enumerate(rows):
                if not bits:
                    continue
                for c in range(GLYPH_WIDTH):
                    if bits & (1 << (GLYPH_WIDTH - 1 - c)):
                        px, py = x + c * scale, y + r * scale
                        self.fill_rect(px, py, px + scale, py + scale, color)
            x += (GLYPH_WIDTH + SPACING) * scale

    def to_png(self) -> bytes:
        return encode_png(self.width, self.height, self.pixels)


def render_chart(canvas: Canvas, chart: Chart, oy: int, width: int, height: int) -> None:
    """Draw ``chart`` into the band of ``canvas`` starting at row ``oy``."""
    left, top, right, bottom = chart.plot_box(width, height)
    grid, axis = hex_color(COLORS["grid"]), hex_color(COLORS["axis"])

    def px(x: float, y: float) -> tuple[float, float]:
        cx, cy = chart.to_px(x, y, width, height)
        return cx, cy + oy

    canvas.text(left, oy + 8, chart.title, BLACK)
    half = GLYPH_HEIGHT // 2
    for y in chart.y_ticks:
        _, cy = px(chart.x_range[0], y)
        canvas.line(left, cy, right, cy, grid)
        label = format_tick(y)
        canvas.text(left - 6 - text_width(label), round(cy) - half, label, BLACK)
    for x in chart.x_ticks:
        cx, _ = px(x, chart.y_range[0])
        canvas.line(cx, oy + bottom, cx, oy + bottom + 5, axis)
        label = format_tick(x)
        canvas.text(round(cx) - text_width(label) // 2, oy + bottom + 9, label, BLACK)
    for bar in chart.bars:
        x0, y0 = px(bar.x0, bar.height)
        x1, _ = px(bar.x1, 0.0)
        canvas.fill_rect(
            round(x0),
            round(y0),
            max(round(x1) - 1, round(x0) + 1),
            oy + bottom,
            hex_color(chart.bar_color),
        )
    for series in chart.lines:
        color = hex_color(series.color)
        pts = [px(x, y) for x, y in series.points]
        if len(pts) == 1:
            cx, cy = pts[0]
            canvas.fill_rect(round(cx) - 2, round(cy) - 2, round(cx) + 3, round(cy) + 3, color)
        for (ax, ay), (bx, by) in itertools.pairwise(pts):
            canvas.line(ax, ay, bx, by, color, width=2, dash=5 if series.dashed else 0)
    canvas.line(left, oy + bottom, right, oy + bottom, axis)
    canvas.line(left, oy + top, left, oy + bottom, axis)
    label_x = (left + right) // 2 - text_width(chart.x_label) // 2
    canvas.text(label_x, oy + height - 14, chart.x_label, BLACK)
    canvas.text(4, oy + top - 12, chart.y_label, BLACK)
    lx = right - 150
    shown = [s for s in chart.lines if s.points]
    if shown:  # a white box, so the legend stays legible over the lines
        canvas.fill_rect(lx - 6, oy + top + 2, right - 2, oy + top + 10 + 13 * len(shown), WHITE)
    for i, series in enumerate(shown):
        ly = oy + top + 6 + 13 * i
        color = hex_color(series.color)
        canvas.fill_rect(lx, ly + 2, lx + 18, ly + 4, color)
        canvas.text(lx + 24, ly, series.label, BLACK)
    if chart.empty_note:
        note = chart.empty_note
        canvas.text((left + right - text_width(note)) // 2, oy + (top + bottom) // 2, note)


def png_report(result: LoadResult, width: int = WIDTH, chart_height: int = CHART_HEIGHT) -> bytes:
    """The run's charts (latency over time, throughput, histogram) stacked in one PNG."""
    charts = charts_for(result)
    canvas = Canvas(width, chart_height * len(charts))
    for i, chart in enumerate(charts):
        render_chart(canvas, chart, i * chart_height, width, chart_height)
    return canvas.to_png()
