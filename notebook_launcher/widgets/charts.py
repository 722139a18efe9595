"""Small pictures the course draws from numbers its ranks measured (no matplotlib).

Each is an ordinary display output: HTML with the picture as an SVG image (kept by HTML
sanitisers, shown by nbconvert and without a kernel) and a plain-text twin holding the
numbers, so a saved notebook keeps both.

- :class:`StackedBars`: bytes per rank by part (parameters, gradients, optimizer state) for
  several set-ups side by side, e.g. DDP against the ZeRO stages.
- :class:`Timeline`: what each rank did when, e.g. the stages of a pipeline and its bubble.
- :class:`Measured`: measured points against a model's line, several series on log-log axes
  with ticks and units, e.g. the times of all_reduce, reduce_scatter and all_gather over sizes
  against each one's fitted latency and bandwidth, ``alpha + beta * S``.

Their colours are greys and shapes: blue and red are the inspector's signs of values, and
the ranks' colours are the ownership pictures'; a chart never borrows either meaning.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence

PART_COLOURS = ("#3d3d3d", "#8f8f8f", "#d6d6d6", "#5f5f5f", "#b3b3b3", "#1a1a1a")
_FONT = 'font-family="sans-serif" font-size="10"'


def _image(svg: str, width: float, height: float, alt: str, kind: str) -> str:
    data = base64.b64encode(svg.encode()).decode()
    return (
        f'<img class="nl-picture nl-{kind}" alt="{html.escape(alt)}" width="{width:.0f}" height="{height:.0f}" '
        f'style="display: block; margin: 3px 0;" src="data:image/svg+xml;base64,{data}">'
    )


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class _Shown:
    title = ""

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:
        printer.text(repr(self))  # type: ignore[attr-defined]

    def _repr_mimebundle_(self, include: object = None, exclude: object = None) -> dict[str, str]:
        return {"text/plain": self.text(), "text/html": self._repr_html_()}

    def text(self) -> str:
        raise NotImplementedError

    def _repr_html_(self) -> str:
        raise NotImplementedError


class StackedBars(_Shown):
    """Bars of bytes, one per set-up (and per source: computed, measured), stacked by part.

    ``bars`` maps a bar's label to ``{part: bytes}``; parts keep the order of the first bar.
    """

    def __init__(self, title: str, bars: Mapping[str, Mapping[str, float]]) -> None:
        self.title = title
        self.bars = {label: dict(parts) for label, parts in bars.items()}
        self.parts = list(dict.fromkeys(p for parts in self.bars.values() for p in parts))

    def total(self, label: str) -> float:
        return sum(self.bars[label].values())

    def text(self) -> str:
        lines = [f"{self.title}:"]
        for label, parts in self.bars.items():
            each = ", ".join(f"{p} {int(v):,}" for p, v in parts.items())
            lines.append(f"  {label}: {int(self.total(label)):,} bytes ({each})")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        bar_h, gap, left, width = 18, 6, 150, 300
        top = max((self.total(label) for label in self.bars), default=0) or 1
        items = []
        for i, (label, parts) in enumerate(self.bars.items()):
            y = i * (bar_h + gap)
            items.append(
                f'<text x="{left - 6}" y="{y + bar_h / 2 + 3.5}" text-anchor="end" {_FONT}>{html.escape(label)}</text>'
            )
            x = float(left)
            for part, value in parts.items():
                w = value / top * width
                colour = PART_COLOURS[self.parts.index(part) % len(PART_COLOURS)]
                items.append(
                    f'<rect x="{x:.2f}" y="{y}" width="{max(w, 0):.2f}" height="{bar_h}" fill="{colour}" '
                    f'stroke="#fff" stroke-width="0.5"><title>{html.escape(f"{label}: {part} {int(value):,} bytes")}</title></rect>'
                )
                x += w
            items.append(
                f'<text x="{x + 4:.2f}" y="{y + bar_h / 2 + 3.5}" {_FONT}>{html.escape(_bytes(self.total(label)))}</text>'
            )
        h = len(self.bars) * (bar_h + gap)
        legend_y = h + 8
        x = float(left)
        for j, part in enumerate(self.parts):
            items.append(
                f'<rect x="{x}" y="{legend_y}" width="10" height="10" fill="{PART_COLOURS[j % len(PART_COLOURS)]}"/>'
            )
            items.append(
                f'<text x="{x + 14}" y="{legend_y + 9}" {_FONT}>{html.escape(part)}</text>'
            )
            x += 14 + 7 * len(part) + 16
        w, total_h = left + width + 80, legend_y + 16
        svg = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{total_h}" viewBox="0 0 {w} {total_h}">'
            f'<rect width="{w}" height="{total_h}" fill="#fff"/>{"".join(items)}</svg>'
        )
        return (
            f'<div class="notebook-launcher-chart"><b>{html.escape(self.title)}</b>'
            f"{_image(svg, w, total_h, self.title, 'bars')}</div>"
        )


class Timeline(_Shown):
    """Rows of labelled spans: ``spans`` are ``(row, label, start, end)`` in seconds.

    Labels ``F<i>`` (a forward pass, filled dark) and ``B<i>`` (a backward pass, light) are
    drawn as a pipeline's textbook figure; white is a row with nothing to do. A time axis in
    milliseconds runs under the rows.
    """

    def __init__(self, title: str, spans: Sequence[tuple[str, str, float, float]]) -> None:
        self.title = title
        self.spans = sorted(spans, key=lambda s: (s[2], s[0]))
        self.rows = list(dict.fromkeys(sorted(s[0] for s in spans)))
        self.start = min((s[2] for s in spans), default=0.0)
        self.end = max((s[3] for s in spans), default=0.0)

    def busy(self, row: str) -> float:
        return sum(e - s for r, _, s, e in self.spans if r == row)

    def idle_fraction(self, row: str) -> float:
        """The part of the whole run (first start to last end, over every row) this row
        spent with nothing to do."""
        whole = self.end - self.start
        return 1 - self.busy(row) / whole if whole > 0 else 0.0

    def order(self, row: str) -> list[str]:
        return [label for r, label, _, _ in self.spans if r == row]

    def gaps(self, row: str) -> list[tuple[str, str, float]]:
        """Each wait between two consecutive spans of ``row``: (before, after, seconds)."""
        mine = [(label, s, e) for r, label, s, e in self.spans if r == row]
        return [(a[0], b[0], max(b[1] - a[2], 0.0)) for a, b in zip(mine, mine[1:])]

    def text(self) -> str:
        lines = [f"{self.title} ({(self.end - self.start) * 1000:.1f} ms):"]
        for row in self.rows:
            lines.append(
                f"  {row}: {' '.join(self.order(row))}; idle {self.idle_fraction(row):.0%}"
            )
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        left, width, row_h, lane_h = 54, 520, 22, 9
        lanes = 2  # above each row: labels of blocks too narrow to hold their own
        band = lanes * lane_h + row_h + 6
        whole = (self.end - self.start) or 1.0
        items = []
        for i, row in enumerate(self.rows):
            y = i * band + lanes * lane_h + 2
            items.append(
                f'<rect x="{left}" y="{y}" width="{width}" height="{row_h}" fill="#fff" stroke="#bbb"/>'
            )
            items.append(
                f'<text x="{left - 6}" y="{y + row_h / 2 + 3.5}" text-anchor="end" {_FONT}>{html.escape(row)}</text>'
            )
            lane_free = [float("-inf")] * lanes  # where each lane's last label ends
            for r, label, s, e in self.spans:
                if r != row:
                    continue
                x, w = left + (s - self.start) / whole * width, max((e - s) / whole * width, 1.0)
                forward = label.startswith("F")
                fill, ink = ("#4a4a4a", "#fff") if forward else ("#c8c8c8", "#111")
                items.append(
                    f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{row_h - 4}" fill="{fill}" stroke="#fff" '
                    f'stroke-width="0.8"><title>{html.escape(f"{row} {label}: {(e - s) * 1000:.2f} ms")}</title></rect>'
                )
                if w >= 6 * len(label) + 2:
                    items.append(
                        f'<text x="{x + w / 2:.2f}" y="{y + row_h / 2 + 3.5}" text-anchor="middle" fill="{ink}" {_FONT}>{html.escape(label)}</text>'
                    )
                    continue
                # Too narrow: the label goes above the row, in the first lane with room, with a
                # tick down to its block. Every block keeps its name.
                centre, half = x + w / 2, 2.6 * len(label) + 1
                lane = next((k for k in range(lanes) if lane_free[k] <= centre - half), None)
                if lane is None:
                    lane = min(range(lanes), key=lambda k: lane_free[k])
                lane_free[lane] = centre + half
                ty = y - 2 - (lanes - 1 - lane) * lane_h
                items.append(
                    f'<line x1="{centre:.2f}" x2="{centre:.2f}" y1="{ty + 1:.1f}" y2="{y + 2}" stroke="#888" stroke-width="0.6"/>'
                    f'<text x="{centre:.2f}" y="{ty:.1f}" text-anchor="middle" fill="#222" font-family="sans-serif" font-size="8">{html.escape(label)}</text>'
                )
        axis = len(self.rows) * band
        items.append(
            f'<line x1="{left}" x2="{left + width}" y1="{axis}" y2="{axis}" stroke="#555"/>'
        )
        for tick in _ticks(whole * 1000):
            x = left + tick / (whole * 1000) * width
            items.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{axis}" y2="{axis + 4}" stroke="#555"/>'
                f'<text x="{x:.1f}" y="{axis + 14}" text-anchor="middle" {_FONT}>{tick:g}</text>'
            )
        items.append(
            f'<text x="{left + width}" y="{axis + 27}" text-anchor="end" {_FONT}>time since the first span (ms)</text>'
            f'<rect x="{left}" y="{axis + 19}" width="10" height="10" fill="#4a4a4a"/>'
            f'<text x="{left + 14}" y="{axis + 27}" {_FONT}>forward</text>'
            f'<rect x="{left + 62}" y="{axis + 19}" width="10" height="10" fill="#c8c8c8"/>'
            f'<text x="{left + 76}" y="{axis + 27}" {_FONT}>backward</text>'
            f'<rect x="{left + 130}" y="{axis + 19}" width="10" height="10" fill="#fff" stroke="#bbb"/>'
            f'<text x="{left + 144}" y="{axis + 27}" {_FONT}>idle</text>'
        )
        w, h = left + width + 16, axis + 34
        svg = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">'
            f'<rect width="{w}" height="{h}" fill="#fff"/>{"".join(items)}</svg>'
        )
        return (
            f'<div class="notebook-launcher-chart"><b>{html.escape(self.title)}</b>'
            f"{_image(svg, w, h, self.title, 'timeline')}</div>"
        )


def _ticks(span: float) -> list[float]:
    """Round tick values from 0 to ``span``: 4 to 10 of them, at 1, 2 or 5 times a power of ten."""
    if span <= 0:
        return [0.0]
    for step in (m * 10**e for e in range(math.floor(math.log10(span)) - 1, 99) for m in (1, 2, 5)):
        if span / step <= 10:
            return [round(i * step, 12) for i in range(int(span / step + 1e-9) + 1)]
    return [0.0, span]


_MARKERS = ("circle", "square", "triangle")
_SERIES_COLOURS = ("#1a1a1a", "#6b6b6b", "#a0a0a0")
_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))


def _bytes_tick(n: float) -> str:
    for size, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def _seconds_tick(t: float) -> str:
    for size, unit in _UNITS:
        if t >= size * 0.999:
            return f"{t / size:g} {unit}"
    return f"{t:g} s"


class Measured(_Shown):
    """Measured ``(bytes, seconds)`` points against a model ``alpha + beta * bytes`` per series,
    on log-log axes with ticks and units.

    ``series`` maps a name (``"all_reduce"``) to its points; ``models`` maps the same names to
    ``(alpha, beta)``: a fixed cost in seconds and seconds per byte.
    """

    def __init__(
        self,
        title: str,
        series: Mapping[str, Sequence[tuple[float, float]]],
        models: Mapping[str, tuple[float, float]],
        x_name: str = "bytes",
        y_name: str = "seconds",
    ) -> None:
        self.title = title
        self.series = {k: [(float(x), float(y)) for x, y in v] for k, v in series.items()}
        self.models = {k: (float(a), float(b)) for k, (a, b) in models.items()}
        self.x_name, self.y_name = x_name, y_name

    def model(self, name: str, x: float) -> float:
        alpha, beta = self.models[name]
        return alpha + beta * x

    def text(self) -> str:
        lines = [f"{self.title}:"]
        for name, points in self.series.items():
            alpha, beta = self.models.get(name, (math.nan, math.nan))
            lines.append(
                f"  {name}: model alpha {alpha:.3g} s + beta {beta:.3g} s/byte"
                f" (bandwidth {1 / beta if beta > 0 else math.inf:.3g} bytes/s)"
            )
            for x, y in points:
                fitted = f", model {self.model(name, x):.4g}" if name in self.models else ""
                lines.append(f"    {self.x_name} {x:,.0f}: {self.y_name} {y:.4g}{fitted}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        left, right, top, width, height = 62, 20, 10, 400, 220
        xs = [x for points in self.series.values() for x, _ in points]
        ys = [y for points in self.series.values() for _, y in points]
        ys += [self.model(n, x) for n in self.models if n in self.series for x in xs]
        positive = [y for y in ys if y > 0] or [1.0]
        lx0, lx1 = math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs)))
        ly0, ly1 = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
        lx1, ly1 = max(lx1, lx0 + 1), max(ly1, ly0 + 1)

        def sx(x: float) -> float:
            return left + (math.log10(x) - lx0) / (lx1 - lx0) * width

        def sy(y: float) -> float:
            return top + height - (math.log10(max(y, 10**ly0)) - ly0) / (ly1 - ly0) * height

        items = [
            f'<rect x="{left}" y="{top}" width="{width}" height="{height}" fill="none" stroke="#999"/>'
        ]
        # x ticks at powers of four (4 KiB, 16 KiB, ...) within the range; y ticks at decades.
        power = 2 ** math.ceil(math.log2(10**lx0))
        while power <= 10**lx1:
            if math.log2(power) % 2 == 0 or lx1 - lx0 <= 2:
                x = sx(power)
                items.append(
                    f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + height}" y2="{top + height + 4}" stroke="#555"/>'
                    f'<text x="{x:.1f}" y="{top + height + 15}" text-anchor="middle" {_FONT}>{_bytes_tick(power)}</text>'
                )
            power *= 2
        for e in range(ly0, ly1 + 1):
            y = sy(10.0**e)
            items.append(
                f'<line x1="{left - 4}" x2="{left + width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e3e3e3"/>'
                f'<text x="{left - 6}" y="{y + 3.5:.1f}" text-anchor="end" {_FONT}>{_seconds_tick(10.0**e)}</text>'
            )
        items.append(
            f'<text x="{left + width / 2}" y="{top + height + 30}" text-anchor="middle" {_FONT}>'
            f"{html.escape(self.x_name)} per call (log scale)</text>"
            f'<text x="12" y="{top + height / 2}" text-anchor="middle" transform="rotate(-90 12 {top + height / 2})" {_FONT}>'
            f"{html.escape(self.y_name)} per call (log scale)</text>"
        )
        for k, (name, points) in enumerate(self.series.items()):
            colour, marker = _SERIES_COLOURS[k % 3], _MARKERS[k % 3]
            if name in self.models:
                grid = [10 ** (lx0 + (lx1 - lx0) * i / 60) for i in range(61)]
                grid = [x for x in grid if min(xs) / 1.5 <= x <= max(xs) * 1.5]
                line = " ".join(f"{sx(x):.1f},{sy(self.model(name, x)):.1f}" for x in grid)
                items.append(
                    f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-dasharray="5 3" stroke-width="1.2"/>'
                )
            for x, y in points:
                items.append(
                    _marker(marker, sx(x), sy(y), colour, f"{name}, {x:,.0f} bytes: {y:.4g} s")
                )
            ly = top + 14 + 14 * k
            items.append(_marker(marker, left + 12, ly - 3.5, colour, name))
            items.append(
                f'<text x="{left + 22}" y="{ly}" {_FONT}>{html.escape(name)} (dashed: its fit)</text>'
            )
        w, h = left + width + right, top + height + 38
        svg = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">'
            f'<rect width="{w}" height="{h}" fill="#fff"/>{"".join(items)}</svg>'
        )
        return (
            f'<div class="notebook-launcher-chart"><b>{html.escape(self.title)}</b>'
            f"{_image(svg, w, h, self.title, 'measured')}</div>"
        )


def _marker(kind: str, x: float, y: float, colour: str, title: str) -> str:
    tip = f"<title>{html.escape(title)}</title>"
    if kind == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{colour}">{tip}</circle>'
    if kind == "square":
        return f'<rect x="{x - 3.5:.1f}" y="{y - 3.5:.1f}" width="7" height="7" fill="{colour}">{tip}</rect>'
    return (
        f'<polygon points="{x:.1f},{y - 4.5:.1f} {x - 4:.1f},{y + 3:.1f} {x + 4:.1f},{y + 3:.1f}" '
        f'fill="none" stroke="{colour}" stroke-width="1.3">{tip}</polygon>'
    )
