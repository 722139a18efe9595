"""Small pictures the course draws from numbers its ranks measured (no matplotlib).

Each is an ordinary display output: HTML with the picture as an SVG image (kept by HTML
sanitisers, shown by nbconvert and without a kernel) and a plain-text twin holding the
numbers, so a saved notebook keeps both.

- :class:`StackedBars`: bytes per rank by part (parameters, gradients, optimizer state) for
  several set-ups side by side, e.g. DDP against the ZeRO stages.
- :class:`Timeline`: what each rank did when, e.g. the stages of a pipeline and its bubble.
- :class:`Measured`: measured points against a model's line, e.g. all_reduce time over sizes
  against the ring's ``2 (N - 1) / N * S``.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence

PART_COLOURS = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00")
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
    """Rows of labelled spans: ``spans`` are ``(row, label, start, end)`` in seconds."""

    def __init__(self, title: str, spans: Sequence[tuple[str, str, float, float]]) -> None:
        self.title = title
        self.spans = sorted(spans, key=lambda s: (s[2], s[0]))
        self.rows = list(dict.fromkeys(sorted(s[0] for s in spans)))
        self.start = min((s[2] for s in spans), default=0.0)
        self.end = max((s[3] for s in spans), default=0.0)

    def busy(self, row: str) -> float:
        return sum(e - s for r, _, s, e in self.spans if r == row)

    def idle_fraction(self, row: str) -> float:
        """The part of the whole run this row waited: its share of the bubble."""
        whole = self.end - self.start
        return 1 - self.busy(row) / whole if whole > 0 else 0.0

    def text(self) -> str:
        lines = [f"{self.title} ({(self.end - self.start) * 1000:.1f} ms):"]
        for row in self.rows:
            order = " ".join(label for r, label, _, _ in self.spans if r == row)
            lines.append(f"  {row}: {order}; idle {self.idle_fraction(row):.0%}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        left, width, row_h = 70, 480, 22
        whole = (self.end - self.start) or 1.0
        labels = sorted({label.lstrip("FB") for _, label, _, _ in self.spans})
        items = []
        for i, row in enumerate(self.rows):
            y = i * (row_h + 6)
            items.append(f'<rect x="{left}" y="{y}" width="{width}" height="{row_h}" fill="#eee"/>')
            items.append(
                f'<text x="{left - 6}" y="{y + row_h / 2 + 3.5}" text-anchor="end" {_FONT}>{html.escape(row)}</text>'
            )
            for r, label, s, e in self.spans:
                if r != row:
                    continue
                x, w = left + (s - self.start) / whole * width, max((e - s) / whole * width, 1.0)
                micro = label.lstrip("FB")
                colour = (
                    PART_COLOURS[labels.index(micro) % len(PART_COLOURS)]
                    if micro in labels
                    else "#888"
                )
                fill = colour if label.startswith("F") else "#fff"
                items.append(
                    f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{row_h - 4}" fill="{fill}" stroke="{colour}" '
                    f'stroke-width="2"><title>{html.escape(f"{row} {label}: {(e - s) * 1000:.2f} ms")}</title></rect>'
                )
                if w > 16:
                    ink = "#fff" if label.startswith("F") else "#222"
                    items.append(
                        f'<text x="{x + w / 2:.2f}" y="{y + row_h / 2 + 3.5}" text-anchor="middle" fill="{ink}" {_FONT}>{html.escape(label)}</text>'
                    )
        h = len(self.rows) * (row_h + 6) + 14
        items.append(
            f'<text x="{left}" y="{h - 2}" {_FONT}>grey: waiting (the bubble); filled: forward; outlined: backward; '
            f"{whole * 1000:.1f} ms in all</text>"
        )
        w = left + width + 10
        svg = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">'
            f'<rect width="{w}" height="{h}" fill="#fff"/>{"".join(items)}</svg>'
        )
        return (
            f'<div class="notebook-launcher-chart"><b>{html.escape(self.title)}</b>'
            f"{_image(svg, w, h, self.title, 'timeline')}</div>"
        )


class Measured(_Shown):
    """Measured ``(x, y)`` points against a model ``y = slope * x``, on log-log axes."""

    def __init__(
        self,
        title: str,
        points: Sequence[tuple[float, float]],
        slope: float,
        x_name: str,
        y_name: str,
        model_name: str,
    ) -> None:
        self.title, self.points, self.slope = (
            title,
            [(float(x), float(y)) for x, y in points],
            slope,
        )
        self.x_name, self.y_name, self.model_name = x_name, y_name, model_name

    def text(self) -> str:
        lines = [f"{self.title}:"]
        for x, y in self.points:
            lines.append(
                f"  {self.x_name} {x:,.0f}: {self.y_name} {y:.4g}, {self.model_name} {self.slope * x:.4g}"
            )
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        left, width, height = 56, 380, 200
        xs = [x for x, _ in self.points]
        ys = [y for _, y in self.points] + [self.slope * x for x in xs]
        lx0, lx1 = math.log10(min(xs)), math.log10(max(xs))
        positive = [y for y in ys if y > 0]
        ly0, ly1 = math.log10(min(positive)), math.log10(max(positive))
        lx1, ly1 = max(lx1, lx0 + 1e-9), max(ly1, ly0 + 1e-9)

        def sx(x: float) -> float:
            return left + (math.log10(x) - lx0) / (lx1 - lx0) * width

        def sy(y: float) -> float:
            return height - (math.log10(max(y, 10**ly0)) - ly0) / (ly1 - ly0) * height + 8

        items = [
            f'<rect x="{left}" y="8" width="{width}" height="{height}" fill="none" stroke="#999"/>'
        ]
        line = " ".join(f"{sx(x):.1f},{sy(self.slope * x):.1f}" for x in xs)
        items.append(
            f'<polyline points="{line}" fill="none" stroke="#d55e00" stroke-dasharray="4 3" stroke-width="1.5"/>'
        )
        for x, y in self.points:
            items.append(
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3.5" fill="#0072b2">'
                f"<title>{html.escape(f'{self.x_name} {x:,.0f}: {self.y_name} {y:.4g}')}</title></circle>"
            )
        for x in xs[:: max(1, len(xs) // 5)]:
            items.append(
                f'<text x="{sx(x):.1f}" y="{height + 22}" text-anchor="middle" {_FONT}>{x:,.0f}</text>'
            )
        items.append(
            f'<text x="{left}" y="{height + 34}" {_FONT}>{html.escape(self.x_name)} (log scale)</text>'
        )
        items.append(
            f'<text x="{left + 6}" y="22" {_FONT} fill="#0072b2">● {html.escape(self.y_name)} (measured)</text>'
            f'<text x="{left + 6}" y="36" {_FONT} fill="#d55e00">-- {html.escape(self.model_name)}</text>'
        )
        w, h = left + width + 10, height + 40
        svg = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">'
            f'<rect width="{w}" height="{h}" fill="#fff"/>{"".join(items)}</svg>'
        )
        return (
            f'<div class="notebook-launcher-chart"><b>{html.escape(self.title)}</b>'
            f"{_image(svg, w, h, self.title, 'measured')}</div>"
        )
