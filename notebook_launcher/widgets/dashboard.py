"""The live launch dashboard in the cell, built from ipywidgets' own widgets.

It is a launch observer: the launcher calls ``on_event`` from the cell's thread, which
updates the widgets. A metric event carries the log calls a rank made in quick
succession (a rank may log hundreds of thousands of times); they are taken into the
record each metric's values as one column, or queued while the ticker draws. Every other
event updates the record. Widgets are redrawn at most a few times a second, the plot (an
SVG string drawn by ``plot``) at most once a second, so a rank that logs or prints
thousands of times a second cannot flood the frontend or slow the launch. A small ticker
thread, alive only while the launch runs and serialised with the cell's thread by one
lock, takes in the queued metrics, draws what the throttle held back and moves the
elapsed times on.

When the launch ends, the widgets are replaced by the lasting record (``static``): plain
HTML and an inline SVG that a saved notebook, nbconvert and GitHub's viewer show without
a kernel or widget state. Drawing can fail (a frontend gone, a bug): the record is then
written without the plot, and the table always reaches its final state.
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
from typing import Any, Callable

from notebook_launcher.launcher.events import (
    LaunchEvent,
    LaunchFinished,
    LaunchStarted,
    RankFinished,
    RankMetrics,
    RankStarted,
)
from notebook_launcher.widgets import history
from notebook_launcher.widgets import html as views
from notebook_launcher.widgets._compat import html_style, set_titles
from notebook_launcher.widgets.plot import Drawn, render_svg
from notebook_launcher.widgets.record import DashboardRecord
from notebook_launcher.widgets.static import record_html
from notebook_launcher.widgets.text import summary

ROWS_INTERVAL_S = 0.25
OUTPUT_INTERVAL_S = 1.0
PLOT_INTERVAL_S = 1.0
# The plot waits at least this many times its own drawing time between redraws, so a
# slow machine spends at most a fifth of the cell's thread on it.
PLOT_COST_FACTOR = 5.0
# And at least a second per this many bytes of SVG: 16 ranks of 24 metrics (about 1 MB a
# picture) would otherwise cross a remote notebook's connection every second.
PLOT_BYTES_PER_S = 250_000
OUTPUT_LINES_SHOWN = 400
TICK_S = 0.25  # how stale the dashboard may get while no event arrives
# The live widgets appear once a launch has run this long (at the ticker's first tick): a
# launch over sooner shows its lasting record alone, since widgets replaced a moment later
# would cost it more than they show.
SHOW_AFTER_S = 0.2
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"


class DashboardWarning(RuntimeWarning):
    """The dashboard could not be updated; the launch itself goes on unaffected."""


class WidgetDashboard:
    shows_progress = True  # the launcher's printer then leaves out the bars' redraws

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float | None = TICK_S,
        show_after_s: float = SHOW_AFTER_S,
    ) -> None:
        import ipywidgets  # imported here: the launcher must import without it

        self._widgets: Any = ipywidgets
        self.record = DashboardRecord(clock)
        self.previous: DashboardRecord | None = None
        self.box: Any = None
        self._handle: Any = None
        self._broken = False
        self._error: Exception | None = None  # what broke it, until warned about
        self._lock = threading.Lock()
        self._tick_s = tick_s
        self._show_after_s = show_after_s
        self._show_at: float | None = None  # when the live widgets are built
        self._models: list[Any] = []  # every widget model built, closed at the end
        self._stopping = threading.Event()
        self._ticker: threading.Thread | None = None
        # Metric events that came while the ticker was drawing, taken in after it.
        self._metrics: collections.deque[RankMetrics] = collections.deque()
        self._shown = {"rows": -1, "output": -1, "curves": 0}
        self._last = {"rows": 0.0, "output": 0.0, "plot": 0.0}
        self._plot_cost = 0.0
        self._plot_bytes = 0  # of the last picture sent
        self.plot_draws = 0
        self.final_html: str | None = None
        self.ticker_cpu_s = 0.0  # what the ticker thread spent, for benchmarks

    def on_event(self, event: LaunchEvent) -> None:
        if event.__class__ is RankMetrics:  # the hot path: taken in at once unless drawing
            self._metrics.append(event)
            if self._lock.acquire(blocking=False):
                try:
                    self._take_metrics()
                except Exception as error:  # never the launch's problem
                    self._broken, self._error = True, error
                finally:
                    self._lock.release()
            return
        finished = isinstance(event, LaunchFinished)
        if not finished:
            with self._lock:
                try:
                    self._take_metrics()
                    self.record.apply(event)  # even once drawing broke: the record ends right
                    if self._broken:
                        pass
                    elif isinstance(event, LaunchStarted):
                        self.previous = history.previous()
                        self._show_at = self.record.now() + self._show_after_s
                        self._build_when_due()
                        self._start_ticker()
                    elif self._build_when_due():
                        # A rank that starts or ends is shown at once; the rest is throttled.
                        self._refresh(rows_now=isinstance(event, (RankStarted, RankFinished)))
                except Exception as error:  # a display problem must never end a training run
                    self._broken, self._error = True, error
        if finished:
            self._stop_ticker()
            with self._lock:
                self._take_metrics()
                self.record.apply(event)  # the record ends even where drawing broke
                history.keep(self.record)
                self._finish()
        if self._error is not None:
            problem, self._error = self._error, None
            warnings.warn(
                f"The launch dashboard stopped updating because of {type(problem).__name__}: "
                f"{problem}. The launch goes on; its output still appears in the cell.",
                DashboardWarning,
                stacklevel=2,
            )

    def _take_metrics(self) -> None:
        """Apply the queued metric events, in order (with the lock held).

        The cell's thread appends while the ticker may take: each event is popped alone.
        """
        pending = self._metrics
        while pending:
            event = pending.popleft()
            self.record.apply(event)

    # ---- the ticker ---------------------------------------------------------------------
    def _start_ticker(self) -> None:
        if self._tick_s is None:
            return
        self._ticker = threading.Thread(
            target=self._tick, args=(self._tick_s,), name="notebook-launcher-dashboard", daemon=True
        )
        self._ticker.start()

    def _tick(self, interval: float) -> None:
        try:
            self._tick_loop(interval)
        finally:
            self.ticker_cpu_s = time.thread_time()

    def _tick_loop(self, interval: float) -> None:
        while not self._stopping.wait(interval):
            with self._lock:
                if self.record.finished:
                    return
                try:
                    self._take_metrics()
                    if not self._broken and self._build_when_due():
                        self._refresh()
                except Exception as error:  # reported by the cell's thread at its next event
                    self._broken, self._error = True, error
                    return

    def _stop_ticker(self) -> None:
        self._stopping.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None

    # ---- building ---------------------------------------------------------------------
    def _build_when_due(self) -> bool:
        """Build the live widgets once the launch has run ``show_after_s``; True once built."""
        if self.box is None and self._show_at is not None and self.record.now() >= self._show_at:
            self._build()
        return self.box is not None

    def _build(self) -> None:
        w = self._widgets
        now = self.record.now()
        self._last["plot"] = now  # the first picture a second in: a short launch draws once
        # Few widgets, sharing one layout and one style: each widget, layout and style is a
        # model the kernel opens and sends, and that is most of what showing costs.
        layout, style = w.Layout(), html_style(w)
        self.rows = self.header = w.HTML(self._table_html(now), layout=layout, style=style)
        self.plot = w.HTML(
            layout=w.Layout(display="none", max_width="100%", overflow="auto"), style=style
        )
        self.outputs = [
            w.HTML(
                views.output_html(self.record.rows[r], OUTPUT_LINES_SHOWN),
                layout=layout,
                style=style,
            )
            for r in sorted(self.record.rows)
        ]
        self._shown["output"], self._last["output"] = self.record.output_version, now
        # One tab per rank inside one collapsed section: 16 ranks take one row, not 16.
        self.tabs = w.Tab(children=self.outputs, layout=layout)
        self.accordion = w.Accordion(children=[self.tabs], selected_index=None, layout=layout)
        self._title_outputs()
        self.box = w.VBox(
            [self.rows, self.plot, self.accordion],
            layout=w.Layout(
                border="1px solid rgba(128, 128, 128, 0.35)", padding="6px 10px", margin="2px 0"
            ),
        )
        self.box.add_class("notebook-launcher-dashboard")
        self._models = [self.box, self.accordion, self.tabs, self.rows, self.plot, *self.outputs,
                        layout, style, self.plot.layout, self.box.layout]  # fmt: skip
        from IPython.display import display

        self._handle = display(self._bundle(), raw=True, display_id=True)

    def _table_html(self, now: float) -> str:
        return views.header_html(self.record, now) + views.rows_html(self.record, now)

    def _bundle(self) -> dict[str, Any]:
        # The text form travels with the widget: frontends that draw no widgets show it.
        return {
            WIDGET_VIEW_MIME: {
                "version_major": 2,
                "version_minor": 0,
                "model_id": self.box.model_id,
            },
            "text/plain": summary(self.record, self.record.now()),
        }

    def _finish(self) -> None:
        """Replace the widgets by the lasting record, then let their models go."""
        drawn: Drawn | None = None
        problem: str | None = None
        if not self._broken and self.box is not None:
            try:
                self._refresh(rows_now=True, final=True)
            except Exception as error:
                self._broken, self._error = True, error
        try:
            drawn = render_svg(self.record.shown_curves(), self._previous_curves())
        except Exception as error:  # the table still reaches its final state
            problem = f"{type(error).__name__}: {error}"
        self.final_html = record_html(self.record, drawn, problem)
        bundle = {
            "text/html": self.final_html,
            "text/plain": summary(self.record, self.record.now()),
        }
        try:
            if self._handle is not None:
                self._handle.update(bundle, raw=True)
            else:  # a launch over before its widgets were due
                from IPython.display import display

                display(bundle, raw=True)
        except Exception as error:  # reported by on_event; the launch's outcome stands
            self._broken, self._error = True, error
        for widget in self._models:
            try:
                widget.close()
            except Exception:
                continue
        self.record.forget_output()  # kept among the kernel's launches, it shows none of it

    def _previous_curves(self) -> dict[tuple[str, int], Any] | None:
        return self.previous.shown_curves() if self.previous is not None else None

    # ---- throttled redraws --------------------------------------------------------------
    def _refresh(self, rows_now: bool = False, final: bool = False) -> None:
        now = self.record.now()
        record = self.record
        if rows_now or now - self._last["rows"] >= ROWS_INTERVAL_S:
            self._last["rows"] = now
            # Redrawn even without news while ranks run: their elapsed times move on.
            self.rows.value = self._table_html(now)
        if record.output_version != self._shown["output"] and (
            final or now - self._last["output"] >= OUTPUT_INTERVAL_S
        ):
            self._last["output"], self._shown["output"] = now, record.output_version
            for rank, widget in zip(sorted(record.rows), self.outputs):
                widget.value = views.output_html(record.rows[rank], OUTPUT_LINES_SHOWN)
            self._title_outputs()
        wait = max(
            PLOT_INTERVAL_S, PLOT_COST_FACTOR * self._plot_cost, self._plot_bytes / PLOT_BYTES_PER_S
        )
        if (
            not final
            and record.curves_version != self._shown["curves"]
            and now - self._last["plot"] >= wait
        ):
            self._draw_plot()

    def _draw_plot(self) -> None:
        started = time.perf_counter()
        self._shown["curves"] = self.record.curves_version
        drawn = render_svg(self.record.shown_curves(), self._previous_curves())
        caption = views.plot_caption(self.record, drawn)
        self.plot.value = f'{drawn.svg}<div style="font-size: 11px; opacity: 0.65;">{caption}</div>'
        self._plot_bytes = len(self.plot.value)
        self.plot.layout.display = ""
        self.plot_draws += 1
        self._plot_cost = time.perf_counter() - started
        self._last["plot"] = self.record.now()

    def _title_outputs(self) -> None:
        rows = [self.record.rows[rank] for rank in sorted(self.record.rows)]
        total = sum(row.output_lines for row in rows)
        set_titles(self.tabs, [f"rank {row.rank} ({row.output_lines})" for row in rows])
        ranks = len(self.record.rows)
        set_titles(
            self.accordion,
            [
                f"Output of {ranks} rank{'s' if ranks != 1 else ''} ({total} line{'s' if total != 1 else ''})"
            ],
        )
