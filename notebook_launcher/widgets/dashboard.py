"""The live launch dashboard in the cell, built from ipywidgets' own widgets.

It is a launch observer: the launcher calls ``on_event`` from the cell's thread, which
updates the widgets. Every event updates the record (cheap); widgets are redrawn at most a
few times a second, the plot at most once a second (less when drawing takes long), so a
rank that logs or prints thousands of times a second cannot flood the frontend or slow
the launch. Events only come when ranks do something, so a small ticker thread, alive
only while the launch runs and serialised with the cell's thread by one lock, draws what
the throttle held back (the last line before a long silence) and moves the elapsed times
on. After the launch the dashboard stays in the cell as a record of final states, times
and errors.
"""

from __future__ import annotations

import html
import threading
import time
import warnings
from typing import Any, Callable

from notebook_launcher.launcher.events import LaunchEvent, LaunchFinished, LaunchStarted
from notebook_launcher.widgets import html as views
from notebook_launcher.widgets.plot import describe, load_matplotlib, render_png, shown_width
from notebook_launcher.widgets.record import LaunchRecord
from notebook_launcher.widgets.text import summary

ROWS_INTERVAL_S = 0.25
OUTPUT_INTERVAL_S = 1.0
PLOT_INTERVAL_S = 1.0
# The plot waits at least this many times its own drawing time between redraws, so a
# slow machine spends at most a fifth of the cell's thread on it.
PLOT_COST_FACTOR = 5.0
OUTPUT_LINES_SHOWN = 400
TICK_S = 0.5  # how stale the dashboard may get while no event arrives
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"


class DashboardWarning(RuntimeWarning):
    """The dashboard could not be updated; the launch itself goes on unaffected."""


class WidgetDashboard:
    def __init__(self, clock: Callable[[], float] = time.monotonic, tick_s: float | None = TICK_S) -> None:
        import ipywidgets  # imported here: the launcher must import without it

        self._widgets: Any = ipywidgets
        self.record = LaunchRecord(clock)
        self.box: Any = None
        self._handle: Any = None
        self._broken = False
        self._error: Exception | None = None  # what broke it, until warned about
        self._lock = threading.Lock()
        self._tick_s = tick_s
        self._stopping = threading.Event()
        self._ticker: threading.Thread | None = None
        self._shown = {"rows": -1, "output": -1, "curves": 0}
        self._last = {"rows": 0.0, "output": 0.0, "plot": 0.0}
        self._plot_cost = 0.0
        self.plot_draws = 0

    def on_event(self, event: LaunchEvent) -> None:
        finished = isinstance(event, LaunchFinished)
        if not self._broken:
            with self._lock:
                try:
                    self.record.apply(event)
                    if isinstance(event, LaunchStarted):
                        self._build()
                        self._start_ticker()
                    elif self.box is not None:
                        self._refresh(force=finished)
                        if finished:
                            self._show_final_text()
                except Exception as error:  # a display problem must never end a training run
                    self._broken, self._error = True, error
        if finished:
            self._stop_ticker()
        if self._error is not None:
            problem, self._error = self._error, None
            warnings.warn(
                f"The launch dashboard stopped updating because of {type(problem).__name__}: "
                f"{problem}. The launch goes on; its output still appears in the cell.",
                DashboardWarning,
                stacklevel=2,
            )

    # ---- the ticker ---------------------------------------------------------------------
    def _start_ticker(self) -> None:
        if self._tick_s is None:
            return
        self._ticker = threading.Thread(
            target=self._tick, args=(self._tick_s,), name="notebook-launcher-dashboard", daemon=True
        )
        self._ticker.start()

    def _tick(self, interval: float) -> None:
        while not self._stopping.wait(interval):
            with self._lock:
                if self._broken or self.record.finished:
                    return
                try:
                    self._refresh(force=False)
                except Exception as error:  # reported by the cell's thread at its next event
                    self._broken, self._error = True, error
                    return

    def _stop_ticker(self) -> None:
        self._stopping.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None

    # ---- building ---------------------------------------------------------------------
    def _build(self) -> None:
        w = self._widgets
        now = self.record.now()
        self._last["plot"] = now  # the first picture a second in: a short launch draws once
        self.header = w.HTML(views.header_html(self.record, now))
        self.rows = w.HTML(views.rows_html(self.record, now))
        self.plot = w.Image(format="png", layout=w.Layout(display="none", max_width="100%"))
        self.caption = w.HTML(layout=w.Layout(display="none"))
        self.outputs = [w.HTML(views.output_html(self.record.rows[r], 0)) for r in sorted(self.record.rows)]
        self.accordion = w.Accordion(children=self.outputs, selected_index=None)
        self._title_outputs()
        self.box = w.VBox(
            [self.header, self.rows, self.plot, self.caption, self.accordion],
            layout=w.Layout(
                border="1px solid rgba(128, 128, 128, 0.35)", padding="6px 10px", margin="2px 0"
            ),
        )
        self.box.add_class("notebook-launcher-dashboard")
        from IPython.display import display

        self._handle = display(self._bundle(), raw=True, display_id=True)

    def _bundle(self) -> dict[str, Any]:
        # The text form travels with the widget: frontends that draw no widgets show it.
        return {
            WIDGET_VIEW_MIME: {"version_major": 2, "version_minor": 0, "model_id": self.box.model_id},
            "text/plain": summary(self.record, self.record.now()),
        }

    def _show_final_text(self) -> None:
        if self._handle is not None:
            self._handle.update(self._bundle(), raw=True)

    # ---- throttled redraws --------------------------------------------------------------
    def _refresh(self, force: bool) -> None:
        now = self.record.now()
        record = self.record
        wait = max(PLOT_INTERVAL_S, PLOT_COST_FACTOR * self._plot_cost)
        # The plot first: once the rows say the launch ended, the final picture is sent.
        if record.curves_version != self._shown["curves"] and (force or now - self._last["plot"] >= wait):
            self._draw_plot()
        if force or now - self._last["rows"] >= ROWS_INTERVAL_S:
            self._last["rows"] = now
            # Redrawn even without news while ranks run: their elapsed times move on.
            self.header.value = views.header_html(record, now)
            self.rows.value = views.rows_html(record, now)
        if record.output_version != self._shown["output"] and (
            force or now - self._last["output"] >= OUTPUT_INTERVAL_S
        ):
            self._last["output"], self._shown["output"] = now, record.output_version
            for rank, widget in zip(sorted(record.rows), self.outputs):
                widget.value = views.output_html(record.rows[rank], OUTPUT_LINES_SHOWN)
            self._title_outputs()

    def _draw_plot(self) -> None:
        load_matplotlib()  # a one-off cost, not counted as the drawing's
        started = time.perf_counter()
        self._shown["curves"] = self.record.curves_version
        png = render_png(self.record.curves)
        self.plot.value = png
        self.plot.width = str(shown_width(png))
        # In words under the picture (ipywidgets' Image cannot carry a tooltip: its
        # frontend then fails to draw it again when the output is re-rendered).
        self.caption.value = (
            f'<div style="font-size: 11px; opacity: 0.65;">{html.escape(describe(self.record.curves))}</div>'
        )
        self.caption.layout.display = ""
        self.plot.layout.display = ""
        self.plot_draws += 1
        self._plot_cost = time.perf_counter() - started
        self._last["plot"] = self.record.now()

    def _title_outputs(self) -> None:
        titles = []
        for rank in sorted(self.record.rows):
            row = self.record.rows[rank]
            count = f"{row.output_lines} line{'s' if row.output_lines != 1 else ''}"
            titles.append(f"Output of rank {rank} ({count})")
        self.accordion.titles = tuple(titles)
