"""The plot of what ranks ``log``, drawn as an SVG string by this module (no matplotlib).

An inline SVG renders in every frontend (JupyterLab, Notebook 7, VS Code, Colab, Kaggle,
nbconvert's HTML, GitHub's viewer) with no front-end code and no fetch, and its
``<title>`` elements are the browser's own tooltips: hovering a point shows its step,
rank and value. Drawing is string building over at most a few hundred points per curve,
a few milliseconds even for 20 metrics, so the final picture costs the cell nothing
noticeable. Every piece of user text (metric names) is escaped; non-finite values are
marked, never silently dropped.
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from notebook_launcher.widgets.record import Curve

Curves = dict[tuple[str, int], "Curve"]

PANEL_W, PANEL_H = 300, 168
_LEFT, _RIGHT, _TOP, _BOTTOM = 52, 10, 24, 26
MAX_COLUMNS = 3
MAX_PANELS = 24  # past this many metrics the rest are named, not drawn
POINTS_DRAWN = 240  # per curve: about one per two pixel columns
HOVER_POINTS = 60  # per curve: points that carry a tooltip (each is an element)
# Per panel: many ranks share it, so each curve's tooltips thin out (never under 12 points):
# 16 ranks of 6 metrics would otherwise carry 5,760 elements into every saved notebook.
HOVER_POINTS_PER_PANEL = 160
HOVER_POINTS_MIN = 12
NONFINITE_DRAWN = 24  # per curve: crosses marking NaN/inf (the caption counts them all)
_NAME_CHARS = 44
# tab10, then ten more that stay apart from it; past 20 ranks, hues by the golden angle.
_RANK_COLOURS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#393b79", "#ad494a", "#8ca252", "#e7969c", "#843c39",
    "#6b6ecf", "#d6616b", "#637939", "#7b4173", "#bd9e39",
)  # fmt: skip


def rank_colour(rank: int) -> str:
    if rank < len(_RANK_COLOURS):
        return _RANK_COLOURS[rank]
    hue = (rank * 137.508) % 360
    return f"hsl({hue:.0f}, 65%, {42 + (rank % 3) * 8}%)"


class Drawn(NamedTuple):
    svg: str  # "" when nothing was logged
    caption: str  # plain text: what the picture shows, points drawn of points logged
    points: int  # finite points drawn on the lines


def render_svg(curves: Curves, previous: Curves | None = None) -> Drawn:
    """One panel per metric, one line per rank in it; x is the step (or the log call).

    ``previous`` (the curves of the launch before, in this kernel) are drawn faded and
    dashed under the same metric and rank.
    """
    metrics = sorted({name for name, _ in curves})
    if not metrics:
        return Drawn("", "", 0)
    shown = metrics[:MAX_PANELS]
    columns = min(MAX_COLUMNS, len(shown))
    rows = math.ceil(len(shown) / columns)
    width, height = PANEL_W * columns, PANEL_H * rows
    parts: list[str] = []
    drawn = logged = marked = 0
    compared = False
    for index, metric in enumerate(shown):
        x0, y0 = (index % columns) * PANEL_W, (index // columns) * PANEL_H
        ranks = sorted(rank for name, rank in curves if name == metric)
        before = {
            rank: previous[(metric, rank)]
            for rank in ranks
            if previous and (metric, rank) in previous
        }
        compared = compared or bool(before)
        panel, counts = _panel(
            metric, {rank: curves[(metric, rank)] for rank in ranks}, before, x0, y0
        )
        parts.append(panel)
        drawn, logged, marked = drawn + counts[0], logged + counts[1], marked + counts[2]
    logged += sum(curves[key].calls for key in curves if key[0] not in shown)
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="nl-plot" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" style="max-width: 100%; height: auto;" font-family="sans-serif" font-size="10" '
        f'role="img" aria-label="{_attr(_caption(drawn, logged, marked, metrics, shown, compared))}">'
        + "".join(parts)
        + "</svg>"
    )
    return Drawn(svg, _caption(drawn, logged, marked, metrics, shown, compared), drawn)


def _caption(
    drawn: int, logged: int, marked: int, metrics: list[str], shown: list[str], compared: bool
) -> str:
    text = f"{drawn:,} point{'s' if drawn != 1 else ''} drawn of {logged:,} logged"
    if marked:
        text += (
            f"; {marked:,} NaN/inf value{'s' if marked != 1 else ''} logged, marked with a cross"
        )
    if len(shown) < len(metrics):
        rest = ", ".join(_short(m) for m in metrics[len(shown) :][:10])
        text += f"; {len(metrics) - len(shown)} more metrics not drawn ({rest}{', …' if len(metrics) - len(shown) > 10 else ''})"
    if compared:
        text += "; faded dashed lines on a pale band: the previous launch in this kernel"
    return text + ". Hover a point for its step, rank and value."


def _panel(
    metric: str, curves: dict[int, Curve], before: dict[int, Curve], x0: float, y0: float
) -> tuple[str, tuple[int, int, int]]:
    left, right = x0 + _LEFT, x0 + PANEL_W - _RIGHT
    top, bottom = y0 + _TOP, y0 + PANEL_H - _BOTTOM
    name = _short(metric)
    out = [f'<text x="{x0 + _LEFT}" y="{y0 + 14}" font-size="11" font-weight="bold" fill="currentColor">'
           f"<title>{_text(metric[:2000])}</title>{_text(name)}</text>"]  # fmt: skip
    sampled = {rank: _sample(curve) for rank, curve in curves.items()}
    old = {rank: _sample(curve) for rank, curve in before.items()}
    finite = [v for pts in (*sampled.values(), *old.values()) for _, v in pts if math.isfinite(v)]
    steps = [s for pts in (*sampled.values(), *old.values()) for s, _ in pts]
    logged = sum(curve.calls for curve in curves.values())
    nonfinite = sum(curve.nonfinite_calls for curve in curves.values())
    out.append(
        f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" '
        'stroke="currentColor" stroke-opacity="0.25"/>'
    )
    if not finite:
        what = (
            "all values are NaN"
            if all(math.isnan(v) for pts in sampled.values() for _, v in pts)
            else "no finite values"
        )
        out.append(
            f'<text x="{(left + right) / 2}" y="{(top + bottom) / 2}" text-anchor="middle" fill="#d62728">'
            f"{what} ({logged:,} logged)</text>"
        )
    lo_s, hi_s = (min(steps), max(steps)) if steps else (0.0, 1.0)
    if hi_s == lo_s:
        lo_s, hi_s = lo_s - 1, hi_s + 1
    lo_v, hi_v = (min(finite), max(finite)) if finite else (0.0, 1.0)
    log_scale = lo_v > 0 and hi_v / lo_v > 100
    if log_scale:
        lo_v, hi_v = math.log10(lo_v), math.log10(hi_v)
    if hi_v == lo_v:
        lo_v, hi_v = lo_v - (abs(lo_v) or 1) * 0.1, hi_v + (abs(hi_v) or 1) * 0.1
    pad = (hi_v - lo_v) * 0.06
    lo_v, hi_v = lo_v - pad, hi_v + pad

    def sx(step: float) -> float:
        return left + (step - lo_s) / (hi_s - lo_s) * (right - left)

    def sy(value: float) -> float:
        v = math.log10(value) if log_scale else value
        return bottom - (v - lo_v) / (hi_v - lo_v) * (bottom - top)

    if finite:
        for fraction in (0.0, 0.5, 1.0):
            v = lo_v + pad + fraction * (hi_v - lo_v - 2 * pad)
            shown = 10**v if log_scale else v
            y = bottom - (v - lo_v) / (hi_v - lo_v) * (bottom - top)
            out.append(
                f'<line x1="{left}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="currentColor" stroke-opacity="0.1"/>'
                f'<text x="{left - 4}" y="{y + 3:.1f}" text-anchor="end" fill="currentColor" fill-opacity="0.7">{_tick(shown)}</text>'
            )
    for step, anchor in ((lo_s, "start"), (hi_s, "end")):
        if steps:
            out.append(
                f'<text x="{sx(step):.1f}" y="{bottom + 13}" text-anchor="{anchor}" fill="currentColor" '
                f'fill-opacity="0.7">{_tick(step)}</text>'
            )
    out.append(
        f'<text x="{(left + right) / 2}" y="{bottom + 13}" text-anchor="middle" fill="currentColor" '
        f'fill-opacity="0.5">step</text>'
    )
    if log_scale:  # said at the y axis it is about, not in the x axis's label
        out.append(
            f'<text x="{left - 4}" y="{top - 4}" text-anchor="end" fill="currentColor" '
            f'fill-opacity="0.5">log</text>'
        )
    for rank, points in old.items():
        # A NaN breaks no line: the line joins the finite points around it; the cross marks it.
        line = _path([(sx(s), sy(v)) for s, v in points if math.isfinite(v)])
        if line:
            # A wide pale band under the dashes: still seen where this launch's line lies
            # exactly on it (the same curve twice is the point of comparing launches).
            out.append(
                f'<path d="{line}" fill="none" stroke="{rank_colour(rank)}" stroke-width="7" '
                f'stroke-opacity="0.18" stroke-linecap="round" stroke-linejoin="round"/>'
                f'<path d="{line}" fill="none" stroke="{rank_colour(rank)}" stroke-width="1.2" '
                f'stroke-opacity="0.55" stroke-dasharray="4 3"><title>previous launch: rank {rank}, '
                f"{_text(name)}</title></path>"
            )
    drawn = 0
    label = _text(name)
    hover = max(HOVER_POINTS_MIN, min(HOVER_POINTS, HOVER_POINTS_PER_PANEL // max(1, len(sampled))))
    for rank, points in sampled.items():
        colour = rank_colour(rank)
        finite_points = [(s, v) for s, v in points if math.isfinite(v)]
        # Each point's place computed once, for the line and for its hover circle.
        placed = [(sx(s), sy(v)) for s, v in finite_points]
        if placed:
            out.append(
                f'<path d="{_path(placed)}" fill="none" stroke="{colour}" stroke-width="1.5">'
                f"<title>rank {rank}, {label}</title></path>"
            )
        drawn += len(finite_points)
        every = max(1, math.ceil(len(finite_points) / hover))
        picked = list(range(0, len(finite_points), every))
        if finite_points and picked[-1] != len(finite_points) - 1:
            picked.append(len(finite_points) - 1)
        radius = 2.5 if len(points) < 40 else 2
        # The colour and class once per curve, on the group: most of a saved record's size.
        circle = f'" r="{radius}"><title>step '
        tail = f", rank {rank}, {label} = "
        if picked:
            out.append(f'<g class="nl-point" fill="{colour}">')
            out.extend([
                f'<circle cx="{placed[i][0]:.1f}" cy="{placed[i][1]:.1f}{circle}{_tick(finite_points[i][0])}{tail}'
                f"{finite_points[i][1]:.6g}</title></circle>"
                for i in picked
            ])  # fmt: skip
            out.append("</g>")
        odd = [(s, v) for s, v in points if not math.isfinite(v)]
        for s, v in odd[:: max(1, math.ceil(len(odd) / NONFINITE_DRAWN))]:
            # NaN and -inf sit on the bottom edge, +inf on the top, as a red cross.
            y = top + 4 if v > 0 else bottom - 4
            x = sx(s)
            out.append(
                f'<g class="nl-nonfinite"><title>step {_tick(s)}, rank {rank}, {_text(name)} = {v}</title>'
                f'<path d="M{x - 3:.1f},{y - 3:.1f}L{x + 3:.1f},{y + 3:.1f}M{x - 3:.1f},{y + 3:.1f}L{x + 3:.1f},{y - 3:.1f}" '
                f'stroke="#d62728" stroke-width="1.6"/>'
                f'<rect x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8" fill="{colour}" fill-opacity="0.01"/></g>'
            )
    if nonfinite and finite:
        out.append(
            f'<text x="{right}" y="{y0 + 14}" text-anchor="end" fill="#d62728">{nonfinite} NaN/inf</text>'
        )
    return "".join(out), (drawn, logged, nonfinite)


def _sample(curve: Curve) -> list[tuple[float, float]]:
    """At most POINTS_DRAWN points, always the last, and every non-finite one kept."""
    steps, values = curve.steps, curve.values  # read in place: only the points drawn are copied
    n = len(values)
    every = max(1, math.ceil((n + (curve.last is not None)) / POINTS_DRAWN))
    picked = list(zip(steps[::every], values[::every]))
    last = curve.latest()
    if last is not None and (not picked or picked[-1][0] != last[0]):
        picked.append(last)
    if every > 1:
        taken = {step for step, _ in picked}
        odd = [(s, v) for s, v in curve.nonfinite if s not in taken]
        if odd:
            picked = sorted([*picked, *odd[:POINTS_DRAWN]], key=lambda point: point[0])
    return picked


def _path(placed: list[tuple[float, float]]) -> str:
    """A path through these points, in tenths of a pixel: the first absolute, the rest as
    steps from the one before, which is about half the text of absolute coordinates."""
    if not placed:
        return ""
    tenths = [(round(x * 10), round(y * 10)) for x, y in placed]
    x0, y0 = tenths[0]
    moves = [f"M{_decimal(x0)} {_decimal(y0)}"]
    if len(tenths) > 1:
        moves.append("l" + " ".join(
            f"{_decimal(x - px)} {_decimal(y - py)}" for (px, py), (x, y) in zip(tenths, tenths[1:])
        ))  # fmt: skip
    return "".join(moves)


def _decimal(tenths: int) -> str:
    """``tenths / 10`` as the shortest SVG number: 12 -> "1.2", -4 -> "-.4", 30 -> "3"."""
    whole, tenth = divmod(abs(tenths), 10)
    sign = "-" if tenths < 0 else ""
    if not tenth:
        return f"{sign}{whole}"
    return f"{sign}{whole or ''}.{tenth}"


def _tick(value: float) -> str:
    if value != value or math.isinf(value):
        return str(value)
    if float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    if 1000 <= abs(value) < 1e6:  # "1014", not "1.01e+03"
        return f"{value:.0f}"
    return f"{value:.3g}"


def _short(name: str) -> str:
    return name if len(name) <= _NAME_CHARS else name[: _NAME_CHARS - 1] + "…"


def _text(text: str) -> str:
    return html.escape(text, quote=False)


def _attr(text: str) -> str:
    return html.escape(text, quote=True)
