"""The live plot: every rank's logged metrics drawn as a PNG picture.

A picture (matplotlib's Agg canvas, no pyplot and no GUI backend) renders in every
frontend as a plain image, needs no front-end code and fetches nothing at render time.
matplotlib is imported on the first draw, so launches that log nothing never pay for it.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from notebook_launcher.widgets.record import Curve

_PANEL_SIZE_IN = (4.2, 2.6)
_MAX_COLUMNS = 3
_POINTS_DRAWN = 1000  # per curve: about one per pixel column; more only costs drawing time
_DPI = 100  # CSS pixels per inch as shown
_SCALE = 2  # drawn at twice the size shown, so it stays sharp on high-density screens
# One colour per rank, the same in every panel (matplotlib's default cycle, tab10).
_RANK_COLOURS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip


def rank_colour(rank: int) -> str:
    return _RANK_COLOURS[rank % len(_RANK_COLOURS)]


def describe(curves: dict[tuple[str, int], Curve]) -> str:
    """What the picture shows, in words (its tooltip, and what a screen reader reads)."""
    parts = []
    for metric in sorted({name for name, _ in curves}):
        ranks = sorted(rank for name, rank in curves if name == metric)
        shown = ", ".join(f"rank {rank} ({curves[(metric, rank)].calls} points)" for rank in ranks)
        parts.append(f"{metric} by step: {shown}")
    return "; ".join(parts)


def shown_width(png: bytes) -> int:
    """The width in CSS pixels to show a picture made by :func:`render_png` at."""
    return int.from_bytes(png[16:20], "big") // _SCALE


def load_matplotlib() -> None:
    """Import what drawing needs (about a second, once per kernel), apart from drawing."""
    import matplotlib.backends.backend_agg
    import matplotlib.figure  # noqa: F401


def render_png(curves: dict[tuple[str, int], Curve]) -> bytes:
    """One panel per metric, one line per rank in it; x is the step (or the log call)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics = sorted({name for name, _ in curves})
    columns = min(_MAX_COLUMNS, max(1, len(metrics)))
    rows = math.ceil(len(metrics) / columns) if metrics else 1
    width, height = _PANEL_SIZE_IN[0] * columns, _PANEL_SIZE_IN[1] * rows
    figure = Figure(figsize=(width, height), dpi=_DPI)
    FigureCanvasAgg(figure)
    # Fixed margins (in inches) instead of a layout engine, which doubled the drawing time.
    figure.subplots_adjust(
        left=0.6 / width, right=1 - 0.15 / width, bottom=0.45 / height, top=1 - 0.3 / height,
        wspace=0.35, hspace=0.5,
    )  # fmt: skip
    for index, metric in enumerate(metrics):
        axes = figure.add_subplot(rows, columns, index + 1)
        ranks = sorted(rank for name, rank in curves if name == metric)
        for rank in ranks:
            curve = curves[(metric, rank)]
            stride = max(1, math.ceil(len(curve.values) / _POINTS_DRAWN))
            steps, values = curve.steps[::stride], curve.values[::stride]
            if stride > 1 and steps[-1] != curve.steps[-1]:  # always end at the latest point
                steps, values = [*steps, curve.steps[-1]], [*values, curve.values[-1]]
            marker = "o" if len(values) < 30 else None
            axes.plot(
                steps, values, label=f"rank {rank}", color=rank_colour(rank),
                linewidth=1.4, marker=marker, markersize=3,
            )  # fmt: skip
        axes.set_title(metric, fontsize=10)
        axes.set_xlabel("step", fontsize=8)
        axes.tick_params(labelsize=8)
        axes.grid(True, alpha=0.3)
        if _positive_and_wide(curves, metric, ranks):
            axes.set_yscale("log")  # a loss falling over decades stays readable
        axes.legend(fontsize=8, loc="upper right", frameon=False)  # "best" searches: slow
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=_DPI * _SCALE)
    return buffer.getvalue()


def _positive_and_wide(curves: dict[tuple[str, int], Curve], metric: str, ranks: list[int]) -> bool:
    values = [v for rank in ranks for v in curves[(metric, rank)].values if math.isfinite(v)]
    if not values or min(values) <= 0:
        return False
    return max(values) / min(values) > 100
