"""The matplotlib backend of a session's ranks: Agg drawing, and ``show()`` sends the figures
to the notebook cell (see ``rich_output``)."""

from __future__ import annotations

from typing import Any

from matplotlib.backend_bases import FigureManagerBase, _Backend
from matplotlib.backends.backend_agg import FigureCanvasAgg


@_Backend.export
class _BackendRanks(_Backend):
    FigureCanvas = FigureCanvasAgg
    FigureManager = FigureManagerBase

    @staticmethod
    def show(*args: Any, **kwargs: Any) -> None:
        from notebook_launcher.session.rich_output import flush_figures

        flush_figures()
