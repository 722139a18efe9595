"""The widget dashboard: throttled redraws, a drawn plot, a record that stays afterwards."""

from __future__ import annotations

import struct

import pytest

from notebook_launcher.errors import RankFailure
from notebook_launcher.launcher.events import (
    LaunchFinished,
    LaunchStarted,
    OutputLine,
    RankFinished,
    RankMetric,
    RankStarted,
)
from notebook_launcher.widgets.dashboard import DashboardWarning, WidgetDashboard
from notebook_launcher.widgets.plot import render_png
from notebook_launcher.widgets.record import Curve


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def close_widgets():
    """Close this test's widgets while their comms exist (not at interpreter exit)."""
    yield
    import ipywidgets

    ipywidgets.Widget.close_all()


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def board(capsys):
    clock = Clock()
    dashboard = WidgetDashboard(clock, tick_s=None)  # redraws driven by events only
    dashboard.on_event(LaunchStarted(2, "fork", "cpu", "no", None))
    for rank in range(2):
        dashboard.on_event(RankStarted(rank, 1000 + rank, "cpu"))
    yield dashboard, clock
    capsys.readouterr()  # outside a kernel, display() prints the bundle


def count_changes(widget) -> list[object]:
    seen: list[object] = []
    widget.observe(lambda change: seen.append(change["new"]), names="value")
    return seen


def test_a_fast_loop_is_drawn_a_few_times_a_second_not_per_event(board):
    dashboard, clock = board
    rows, plot = count_changes(dashboard.rows), count_changes(dashboard.plot)
    outputs = count_changes(dashboard.outputs[0])
    for step in range(10_000):  # 1,000 metrics and 1,000 lines a second for 10 s
        clock.now += 0.001
        dashboard.on_event(RankMetric(step % 2, {"loss": 1 / (step + 1)}, step // 2))
        dashboard.on_event(OutputLine(0, "stdout", f"step {step}", False))
    assert 1 <= len(plot) <= 11  # at most once a second (less when drawing is slow)
    assert len(rows) <= 41  # at most four times a second
    assert len(outputs) <= 11
    assert dashboard.record.rows[0].output_lines == 10_000


def test_the_final_state_is_drawn_at_once_and_stays(board):
    dashboard, clock = board
    dashboard.on_event(RankMetric(0, {"loss": 0.5}, 0))
    dashboard.on_event(OutputLine(1, "stdout", "about to fail", False))
    clock.now += 0.01  # within every throttle interval: only the final event draws
    failure = RankFailure(1, 1001, 1, "ValueError", "bad batch", "Traceback ...")
    dashboard.on_event(RankFinished(1, 1, failure, "failed"))
    dashboard.on_event(RankFinished(0, -15, None, "stopped"))
    dashboard.on_event(LaunchFinished("failed", 0.01))
    assert "nl-failed" in dashboard.rows.value and "ValueError: bad batch" in dashboard.rows.value
    assert "nl-stopped" in dashboard.rows.value
    assert "failed after 0.0 s" in dashboard.header.value
    assert dashboard.plot.layout.display == "" and png_size(dashboard.plot.value)[0] > 100
    assert "about to fail" in dashboard.outputs[1].value
    assert dashboard.accordion.titles == ("Output of rank 0 (0 lines)", "Output of rank 1 (1 line)")
    assert dashboard.accordion.selected_index is None  # collapsed: raw output on demand


def test_the_plot_stays_hidden_until_a_rank_logs(board):
    dashboard, _ = board
    dashboard.on_event(LaunchFinished("ok", 1.0))
    assert dashboard.plot.layout.display == "none" and dashboard.plot_draws == 0


def test_a_dashboard_failure_warns_once_and_never_ends_the_launch(board, monkeypatch):
    dashboard, clock = board

    def broken(*_):
        raise RuntimeError("frontend gone")

    monkeypatch.setattr("notebook_launcher.widgets.dashboard.render_png", broken)
    clock.now += 5
    with pytest.warns(DashboardWarning, match="The launch dashboard stopped updating because of RuntimeError: frontend gone"):
        dashboard.on_event(RankMetric(0, {"loss": 0.5}, 0))
    dashboard.on_event(LaunchFinished("ok", 5.0))  # ignored quietly


def test_what_the_throttle_held_back_is_drawn_while_ranks_are_silent(capsys):
    import threading
    import time

    dashboard = WidgetDashboard(tick_s=0.05)
    dashboard.on_event(LaunchStarted(1, "fork", "cpu", "no", None))
    dashboard.on_event(RankStarted(0, 1000, "cpu"))
    dashboard.on_event(OutputLine(0, "stdout", "first", False))
    dashboard.on_event(OutputLine(0, "stdout", "then silence", False))  # within the interval
    assert threading.active_count() >= 2
    deadline = time.monotonic() + 30
    while "then silence" not in dashboard.rows.value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "then silence" in dashboard.rows.value
    dashboard.on_event(RankFinished(0, 0, None))
    dashboard.on_event(LaunchFinished("ok", 1.0))
    assert not any(t.name == "notebook-launcher-dashboard" for t in threading.enumerate())
    capsys.readouterr()


def test_the_plot_has_one_panel_per_metric_and_grows_with_them():
    one = render_png({("loss", 0): Curve([0, 1], [1.0, 0.5]), ("loss", 1): Curve([0, 1], [1.1, 0.4])})
    three = render_png({(name, 0): Curve([0, 1], [1.0, 0.5]) for name in ("loss", "lr", "accuracy")})
    assert png_size(three)[0] > 2 * png_size(one)[0]
