"""The rank inspector's drawing: each rank's value side by side, as static HTML with SVG.

Pure functions of the summaries the ranks sent (see ``value_summaries.py``). The result is
an ordinary display output (HTML with the pictures as SVG images, and a plain-text twin), so it stays in the saved notebook
and shows in nbconvert and on GitHub without a kernel. Every piece of user text is escaped,
and the whole record is marked for MathJax to leave alone, so ``$`` stays a dollar sign.
Colours diverge from white at zero (blue negative, red positive) on one scale per name, over
every rank and stage, with a legend: equal values look equal on every rank and before and
after a cell, and a darker colour always means a larger magnitude. A ``DTensor`` sharded
across the ranks is said to be sharded (a neutral badge naming each rank's slices) and drawn
whole, each element in its owner's colour: different shards are the point, not an error. The
same neutral badge marks names the caller says differ by design (``per_rank``: a rank's own
shard of the data, a reduce_scatter's output, gradients under ``no_sync``). Ranks' colours
share nothing with the values' blue and red; a rank's part is drawn at the whole's scale.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import math
import re
from collections import Counter
from collections.abc import Sequence

from notebook_launcher.value_summaries import ValueSummary
from notebook_launcher.widgets.ownership import Ownership, from_shards

EQUAL_COLOUR = "#2ca02c"
DIFFER_COLOUR = "#d62728"
MISSING_COLOUR = "#8c6d31"
SHARDED_COLOUR = "#5b6b7f"  # neutral: shards are meant to differ
PER_RANK_COLOUR = SHARDED_COLOUR  # neutral too: the caller said these values differ by design
NAN_COLOUR = "#e377c2"
INF_COLOUR = "#111111"
# The heatmap's diverging scale: white at zero, blue for negative, red for positive.
ZERO_RGB, NEGATIVE_RGB, POSITIVE_RGB = (247, 247, 247), (33, 102, 172), (178, 24, 43)
_CARD = (
    "display: inline-block; vertical-align: top; margin: 0 8px 8px 0; padding: 6px 8px; "
    "border-radius: 6px; min-width: 120px; max-width: 260px; font-size: 12px; line-height: 1.4;"
)
_MONO = "font-family: var(--jp-code-font-family, monospace);"
_PICTURE_W = 220
_SHOWN_ELEMENTS = 16


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the ranks' values of one name have in common."""

    equal: bool  # present on every rank shown, and the same everywhere
    odd: frozenset[int]  # ranks whose value differs from the most common one (or is missing)
    words: str
    # "equal", "differs", "sharded" (a DTensor's shards: different by design), "per-rank"
    # (different, and the caller said so) or "missing" (some rank lacks the name and the
    # ranks that have it agree)
    state: str = "equal"
    ownership: Ownership | None = None


_MARKS = {"equal": "=", "differs": "≠", "sharded": "⊞", "per-rank": "∥", "missing": "∅"}
_STATE_COLOURS = {
    "equal": EQUAL_COLOUR,
    "differs": DIFFER_COLOUR,
    "sharded": SHARDED_COLOUR,
    "per-rank": PER_RANK_COLOUR,
    "missing": MISSING_COLOUR,
}


def verdict(summaries: Sequence[ValueSummary], per_rank: bool = False) -> Verdict:
    """``per_rank``: the values are meant to differ across the ranks (each rank's own part of
    the data, a reduce_scatter's output): a difference is then said in neutral words, and no
    rank is singled out. Equal values are still said to be equal."""
    present = [s for s in summaries if s.present]
    missing = [s.rank for s in summaries if not s.present]
    counts = Counter(s.key for s in present)
    if not present:
        return Verdict(False, frozenset(missing), "not defined on any rank shown", "missing")
    lacking = (
        f"missing on rank{'s' if len(missing) > 1 else ''} {_ranks(missing)}" if missing else ""
    )
    # Before equality: shards that happen to hold equal numbers are still different parts.
    sharded = _sharding(summaries)
    if sharded is not None:
        words, ownership = sharded
        return Verdict(
            False,
            frozenset(missing),
            "; ".join(filter(None, [words, lacking])),
            "sharded",
            ownership,
        )
    if len(counts) == 1 and not missing:
        if len(summaries) == 1:
            return Verdict(True, frozenset(), "one rank shown")
        return Verdict(True, frozenset(), f"equal on every rank ({len(summaries)})")
    if len(counts) == 1:  # the ranks that have it agree; the others lack it
        have = [s.rank for s in present]
        words = (
            f"defined on rank {have[0]} only; {lacking}"
            if len(have) == 1
            else f"{lacking}; equal on the other {len(have)}"
        )
        return Verdict(False, frozenset(missing), words, "missing")
    if per_rank and not missing:
        return Verdict(
            False, frozenset(), f"per rank, by design ({len(counts)} different values)", "per-rank"
        )
    common, most = counts.most_common(1)[0]
    # Outlined: ranks apart from a majority. When every rank holds its own value, none is.
    apart = most > 1
    odd = {s.rank for s in present if apart and s.key != common} | set(missing)
    words = f"differs across ranks ({len(counts)} different values)"
    return Verdict(False, frozenset(odd), "; ".join(filter(None, [words, lacking])), "differs")


_SHARD_NOTE = re.compile(r"local shard of \(([\d, ]*)\) \((.*)\)\Z")
_SHARD = re.compile(r"Shard\(dim=(-?\d+)\)")


def _sharding(summaries: Sequence[ValueSummary]) -> tuple[str, Ownership | None] | None:
    """The neutral words (and the ownership picture) for a DTensor sharded across the ranks."""
    present = [s for s in summaries if s.present]
    notes = {_SHARD_NOTE.match(s.note) for s in present if s.kind == "tensor"}
    if len(present) != len([s for s in present if s.kind == "tensor"]) or None in notes:
        return None
    found = {(m.group(1), m.group(2)) for m in notes if m is not None}
    if len(found) != 1:
        return None
    shape_text, placements = found.pop()
    if "Shard" not in placements:
        return None  # replicated or partial: equal or not by value, as any tensor
    shape = tuple(int(d) for d in shape_text.replace(" ", "").split(",") if d)
    shard = _SHARD.fullmatch(placements)
    if shard is None or not shape:
        return f"sharded ({placements}) across the ranks", None  # a mesh of more dimensions
    dim = int(shard.group(1)) % len(shape)
    sizes = {s.rank: s.shape[dim] if len(s.shape) == len(shape) else 0 for s in present}
    # Slices follow rank order (torch's chunk); the ranges hold when every rank is shown.
    if sorted(sizes) != list(range(len(summaries))) or sum(sizes.values()) != shape[dim]:
        return f"sharded along dim {dim} ({placements})", None
    what = (
        "rows"
        if dim == 0 and len(shape) == 2
        else "columns"
        if dim == 1 and len(shape) == 2
        else ("elements" if len(shape) == 1 else f"dim {dim}")
    )
    spans, start = [], 0
    for rank in sorted(sizes):
        size = sizes[rank]
        spans.append(
            "none" if size == 0 else str(start) if size == 1 else f"{start}-{start + size - 1}"
        )
        start += size
    name = present[0].name
    return f"sharded: {what} {' | '.join(spans)}", from_shards(name, shape, dim, sizes)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


class Inspection:
    """Each rank's values of some names, at one or more moments (e.g. before and after a cell).

    Shown by Jupyter as HTML (``_repr_html_``) with a plain-text twin; ``stages`` holds the
    summaries for code that wants the numbers.
    """

    def __init__(
        self,
        stages: Sequence[tuple[str, dict[str, list[ValueSummary]]]],
        per_rank: Sequence[str] = (),
    ) -> None:
        self.stages = list(stages)
        self.per_rank = frozenset(per_rank)  # names whose values differ by design

    def verdicts(self, stage: int = -1) -> dict[str, Verdict]:
        return {
            name: verdict(s, name in self.per_rank) for name, s in self.stages[stage][1].items()
        }

    def __repr__(self) -> str:
        return render_text(self.stages, self.per_rank)

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:
        printer.text(repr(self))  # type: ignore[attr-defined]

    def _repr_html_(self) -> str:
        return render_html(self.stages, self.per_rank)

    def _repr_mimebundle_(self, include: object = None, exclude: object = None) -> dict[str, str]:
        return {"text/plain": repr(self), "text/html": self._repr_html_()}


# Plain text -----------------------------------------------------------------------------


def render_text(
    stages: Sequence[tuple[str, dict[str, list[ValueSummary]]]],
    per_rank: frozenset[str] = frozenset(),
) -> str:
    lines: list[str] = []
    for label, names in stages:
        for name, summaries in names.items():
            head = f"{name}: {verdict(summaries, name in per_rank).words}"
            lines.append(f"{label}: {head}" if label else head)
            lines += [f"  rank {s.rank}: {describe(s)}" for s in summaries]
    return "\n".join(lines)


def describe(s: ValueSummary) -> str:
    """One line for one rank's value (also the cards' text)."""
    if not s.present:
        return f"not defined ({s.text})"
    if s.kind != "tensor":
        return f"{s.type_name} {s.text}"
    shape = "(" + ", ".join(str(d) for d in s.shape) + ("," if len(s.shape) == 1 else "") + ")"
    what = f"{s.type_name} {s.dtype} {shape} on {s.device}"
    if s.note:
        what += f", {s.note}"
    if s.elements:
        shown = ", ".join(s.elements[:_SHOWN_ELEMENTS])
        more = ", …" if len(s.elements) > _SHOWN_ELEMENTS else ""
        what += f" = {s.text}" if s.shape == () else f" = [{shown}{more}]"
    else:
        what += f", {s.numel:,} elements"
    stats = _stats(s)
    return f"{what}; {stats}" if stats and s.numel > 1 else what


def _stats(s: ValueSummary) -> str:
    parts = []
    if s.minimum is not None and s.maximum is not None and s.mean is not None:
        parts.append(f"min {_num(s.minimum)}, max {_num(s.maximum)}, mean {_num(s.mean)}")
    if s.nan:
        parts.append(f"{s.nan:,} NaN")
    if s.inf:
        parts.append(f"{s.inf:,} inf")
    return ", ".join(parts)


def _num(x: float) -> str:
    return f"{x:.4g}"


# HTML -------------------------------------------------------------------------------------


def render_html(
    stages: Sequence[tuple[str, dict[str, list[ValueSummary]]]],
    per_rank: frozenset[str] = frozenset(),
) -> str:
    scales = _scales(stages)
    parts = [
        '<div class="notebook-launcher-inspector tex2jax_ignore mathjax_ignore" '
        'style="font-size: 12.5px; margin: 2px 0;">'
    ]
    for label, names in stages:
        for name, summaries in names.items():
            parts.append(_name_html(label, name, summaries, scales.get(name), name in per_rank))
    parts.append("</div>")
    return "".join(parts)


def _name_html(
    label: str,
    name: str,
    summaries: list[ValueSummary],
    scale: tuple[float, float] | None,
    per_rank: bool = False,
) -> str:
    v = verdict(summaries, per_rank)
    colour = _STATE_COLOURS[v.state]
    mark = _MARKS[v.state]
    stage = f'<span style="opacity: 0.7;">{html.escape(label)}:</span> ' if label else ""
    head = (
        f'<div style="margin: 4px 0;">{stage}<b style="{_MONO}">{html.escape(name)}</b> '
        f'<span class="nl-verdict" data-equal="{str(v.equal).lower()}" data-state="{v.state}" style="background: {colour}; '
        f'color: white; border-radius: 9px; padding: 0 8px; font-size: 11.5px;">{mark} {html.escape(v.words)}</span></div>'
    )
    whole = ""
    if v.ownership is not None:
        whole = (
            '<div style="font-size: 11.5px; opacity: 0.8;">the whole tensor, each element in the colour of '
            f"the rank that holds it:</div>{v.ownership.picture()}{v.ownership.legend()}"
        )
    cards = "".join(
        _card_html(
            s,
            s.rank in v.odd,
            scale,
            v.ownership.picture(s.rank) if v.ownership and s.present else "",
            # A rank's part at the whole's scale: the part never looks larger than the whole.
            v.ownership.cell() if v.ownership else None,
        )
        for s in summaries
    )
    legend = _legend(scale) if scale is not None and any(s.grid for s in summaries) else ""
    return f'<div class="nl-name" data-name="{html.escape(name)}">{head}{whole}{legend}<div>{cards}</div></div>'


def _legend(scale: tuple[float, float]) -> str:
    """The colour scale: white at zero, blue to -bound, red to +bound, the same for every rank."""
    bound = max(abs(scale[0]), abs(scale[1]))
    steps = 24
    rects = "".join(
        f'<rect x="{i * 5}" y="0" width="5" height="10" fill="{_colour(-bound + 2 * bound * (i + 0.5) / steps, scale)}"/>'
        for i in range(steps)
    )
    svg = f'<svg xmlns="http://www.w3.org/2000/svg" width="120" height="10" viewBox="0 0 120 10">{rects}</svg>'
    data = base64.b64encode(svg.encode()).decode()
    return (
        f'<div class="nl-legend" style="font-size: 11px; margin: 0 0 4px 0; {_MONO}">'
        f'<span>{html.escape(_num(-bound))}</span> <img class="nl-scale" alt="colour scale" width="120" height="10" '
        f'style="vertical-align: middle; border: 1px solid rgba(128,128,128,0.4);" src="data:image/svg+xml;base64,{data}"> '
        f'<span>{html.escape(_num(bound))}</span> <span style="opacity: 0.7;">(white is 0; one scale for every rank)</span></div>'
    )


def _card_html(
    s: ValueSummary,
    odd: bool,
    scale: tuple[float, float] | None,
    owned: str = "",
    cell: int | None = None,
) -> str:
    if not s.present:
        border = MISSING_COLOUR
    else:
        border = DIFFER_COLOUR if odd else "rgba(128, 128, 128, 0.45)"
    style = f"{_CARD} border: {'2px' if odd else '1px'} solid {border};"
    if odd:
        style += " background: rgba(214, 39, 40, 0.07);"
    title = f'<div style="font-weight: 600;">rank {s.rank}</div>'
    if not s.present:
        body = f'<div style="color: {MISSING_COLOUR}; font-weight: 600;">not defined</div><div>{html.escape(s.text)}</div>'
    elif s.kind == "tensor":
        body = (
            f'<div style="opacity: 0.75;">its part of the whole:</div>{owned}' if owned else ""
        ) + _tensor_html(s, scale, cell)
    else:
        body = (
            f'<div style="opacity: 0.7;">{html.escape(s.type_name)}</div>'
            f'<div style="{_MONO} white-space: pre-wrap; overflow-wrap: break-word; font-size: '
            f'{"16px" if s.kind == "number" else "12px"};">{html.escape(s.text)}</div>'
        )
    return (
        f'<div class="nl-card nl-{s.kind}" data-rank="{s.rank}" data-odd="{str(odd).lower()}" '
        f'style="{style}">{title}{body}</div>'
    )


def _tensor_html(
    s: ValueSummary, scale: tuple[float, float] | None, cell: int | None = None
) -> str:
    shape = "(" + ", ".join(str(d) for d in s.shape) + ("," if len(s.shape) == 1 else "") + ")"
    lines = [f'<div style="{_MONO}">{html.escape(s.dtype)} {shape} {html.escape(s.device)}</div>']
    if s.note:
        lines.append(f'<div style="opacity: 0.75;">{html.escape(s.note)}</div>')
    if s.shape == ():
        lines.append(f'<div style="{_MONO} font-size: 16px;">{html.escape(s.text)}</div>')
    elif s.grid:
        lines.append(_svg(s, scale, cell))
        if s.grid_note:
            lines.append(
                f'<div style="opacity: 0.65; font-size: 11px;">{html.escape(s.grid_note)}</div>'
            )
    if s.elements and s.shape != ():
        # The picture shows a matrix's values; its text stays short.
        limit = _SHOWN_ELEMENTS if len(s.shape) == 1 else _SHOWN_ELEMENTS // 2
        shown = ", ".join(_short(e) for e in s.elements[:limit]) + (
            ", …" if len(s.elements) > limit else ""
        )
        # Lines break between numbers, never inside one.
        lines.append(
            f'<div style="{_MONO} overflow-wrap: break-word;">[{html.escape(shown)}]</div>'
        )
    elif s.numel > _SHOWN_ELEMENTS:
        lines.append(f"<div>{s.numel:,} elements</div>")
    stats = _stats(s)
    if stats and s.numel > 1:
        lines.append(f'<div style="opacity: 0.75;">{html.escape(stats)}</div>')
    return "".join(lines)


def _short(element: str) -> str:
    try:
        return f"{float(element):.4g}"
    except ValueError:  # True, 1+2j
        return element


def label(x: float) -> str:
    """A number in a heatmap's cell: three significant figures, its magnitude kept, in at
    most six characters: -2.179 -> "-2.18", 12345 -> "1.23e4", 0.0004 -> "4e-4"."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    magnitude = abs(x)
    if 0.01 <= magnitude < 1000:
        digits = f"{magnitude:.3g}"
        if "e" not in digits:  # 999.7 rounds to 1e+03 in .3g: written below
            return sign + digits
    mantissa, exponent = f"{magnitude:.2e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{sign}{mantissa}e{int(exponent)}"


def _scales(
    stages: Sequence[tuple[str, dict[str, list[ValueSummary]]]],
) -> dict[str, tuple[float, float]]:
    """One colour scale per name, over every rank and stage: equal values, equal colours."""
    found: dict[str, tuple[float, float]] = {}
    for _, names in stages:
        for name, summaries in names.items():
            for s in summaries:
                finite = [x for row in s.grid for x in row if math.isfinite(x)]
                if not finite:
                    continue
                low, high = min(finite), max(finite)
                if name in found:
                    low, high = min(low, found[name][0]), max(high, found[name][1])
                found[name] = (low, high)
    return found


def _colour(x: float, scale: tuple[float, float]) -> str:
    """Diverging around zero, whatever the values' signs: white is 0, blue negative, red
    positive, darker for a larger magnitude, so -4.1 is darker than -1.7."""
    if math.isnan(x):
        return NAN_COLOUR
    bound = max(abs(scale[0]), abs(scale[1]))
    if bound == 0 or not math.isfinite(bound):
        return "#f7f7f7"
    t = max(-1.0, min(1.0, x / bound))
    if t < 0:
        return _mix(ZERO_RGB, NEGATIVE_RGB, -t)
    return _mix(ZERO_RGB, POSITIVE_RGB, t)


def _ink(fill: str) -> str:
    """Dark text on light cells, white on dark ones."""
    r, g, b = (int(fill[i : i + 2], 16) for i in (1, 3, 5))
    return "#222" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#fff"


def _mix(a: tuple[int, int, int], b: tuple[int, int, int], t: float) -> str:
    r, g, bl = (round(p + (q - p) * t) for p, q in zip(a, b))
    return f"#{r:02x}{g:02x}{bl:02x}"


def _svg(s: ValueSummary, scale: tuple[float, float] | None, cell: int | None = None) -> str:
    scale = scale or (0.0, 1.0)
    if len(s.shape) == 1:
        return _bars(s, scale)
    rows, cols = len(s.grid), len(s.grid[0])
    if cell is None:
        cell = max(4, min(24, _PICTURE_W // cols, 160 // rows))
    texts = [label(float(e)) for e in s.elements] if s.elements else []
    # Each value written in its cell when the cells are large enough; a cell widens to hold
    # its number (never cut), unless the picture would then be too wide.
    width = cell
    if texts and cell >= 20:
        width = max(cell, math.ceil(max(len(t) for t in texts) * 5.4 + 4))
        if cols * width > 1.5 * _PICTURE_W:
            texts, width = [], cell
    else:
        texts = []
    rects = []
    for i, row in enumerate(s.grid):
        for j, x in enumerate(row):
            rects.append(
                f'<rect x="{j * width}" y="{i * cell}" width="{width}" height="{cell}" '
                f'fill="{_colour(x, scale)}"/>'
            )
            if texts:
                rects.append(
                    f'<text x="{j * width + width / 2}" y="{i * cell + cell / 2 + 3.5}" font-size="9" '
                    f'font-family="sans-serif" text-anchor="middle" fill="{_ink(_colour(x, scale))}">'
                    f"{html.escape(texts[i * cols + j])}</text>"
                )
    w, h = cols * width, rows * cell
    return _image(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">'
        f"{''.join(rects)}</svg>",
        w,
        h,
        f"heatmap of {s.name} on rank {s.rank}",
        "border: 1px solid rgba(128,128,128,0.4);",
    )


def _image(svg: str, width: int, height: int, alt: str, style: str = "") -> str:
    """The SVG as an image: frontends that sanitise HTML (JupyterLab for a notebook it did
    not run) drop inline SVG but keep images, and nothing in an image can run."""
    data = base64.b64encode(svg.encode()).decode()
    return (
        f'<img class="nl-picture" alt="{html.escape(alt)}" width="{width}" height="{height}" '
        f'style="display: block; margin: 3px 0; {style}" src="data:image/svg+xml;base64,{data}">'
    )


def _bars(s: ValueSummary, scale: tuple[float, float]) -> str:
    values = s.grid[0]
    n = len(values)
    width = max(3, min(24, _PICTURE_W // n))
    h = 60
    low, high = min(scale[0], 0.0), max(scale[1], 0.0)
    span = (high - low) or 1.0
    zero = h - (0 - low) / span * h
    items = [
        f'<line x1="0" x2="{n * width}" y1="{zero:.1f}" y2="{zero:.1f}" stroke="#888" stroke-width="0.5"/>'
    ]
    for i, x in enumerate(values):
        if math.isnan(x):
            top, bottom, fill = 0.0, float(h), NAN_COLOUR
        else:
            y = h - (min(max(x, low), high) - low) / span * h
            top, bottom, fill = min(y, zero), max(y, zero), _colour(x, scale)
            if math.isinf(x):
                fill = INF_COLOUR
        if bottom - top < 2:
            # A zero (or nearly) is a dark stub on the axis: a missing bar would read as "no value".
            top = min(max(zero - 1.5, 0.0), h - 3.0)
            bottom, fill = top + 3.0, "#555"
        items.append(
            f'<rect x="{i * width + 0.5}" y="{top:.1f}" width="{width - 1}" height="{bottom - top:.1f}" '
            f'fill="{fill}" stroke="#555" stroke-width="0.3"/>'
        )
    w = n * width
    return _image(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">'
        f"{''.join(items)}</svg>",
        w,
        h,
        f"bar chart of {s.name} on rank {s.rank}",
    )
