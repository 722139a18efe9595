"""The dashboard's record of a launch, and its text and HTML forms, from launch events."""

from __future__ import annotations

import io

import pytest

from notebook_launcher.errors import RankFailure
from notebook_launcher.launcher.events import (
    GroupRestarting,
    LaunchFinished,
    LaunchStarted,
    OutputLine,
    RankFinished,
    RankMemory,
    RankMetrics,
    RankProgress,
    RankStarted,
)
from notebook_launcher.rank_memory import MachineMemory, machine_memory
from notebook_launcher.widgets import html as views
from notebook_launcher.widgets import record as record_module
from notebook_launcher.widgets.record import (
    METRICS_KEPT,
    POINTS_KEPT,
    DashboardRecord,
    failure_line,
    record_data,
)
from notebook_launcher.widgets.static import record_html
from notebook_launcher.widgets.text import TextDashboard, summary
from tests.support.metric_events import in_batches, logged


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def started(record, clock, ranks=2):
    record.apply(LaunchStarted(ranks, "fork", "cpu", "bf16", None))
    for rank in range(ranks):
        record.apply(RankStarted(rank, 1000 + rank, "cpu"))


def failure(rank=1, **fields) -> RankFailure:
    defaults = {"pid": 1001, "exitcode": 1, "exception_type": "ValueError",
                "message": "learning rate 10.0 is too large\nsecond line", "traceback": "Traceback..."}  # fmt: skip
    return RankFailure(rank, **{**defaults, **fields})


def test_rows_go_from_starting_to_running_to_their_final_state_with_times():
    clock = Clock()
    record = DashboardRecord(clock)
    record.apply(LaunchStarted(2, "fork", "cpu", "no", None))
    assert [row.state for row in record.rows.values()] == ["starting", "starting"]
    record.apply(RankStarted(0, 1000, "cpu"))
    record.apply(RankStarted(1, 1001, "cpu"))
    assert record.rows[1].state == "running" and record.rows[1].pid == 1001
    clock.now += 2.5
    record.apply(RankFinished(0, 0, None))
    record.apply(RankFinished(1, 1, failure(), "failed"))
    clock.now += 10
    assert record.rows[0].state == "done" and record.rows[0].elapsed(clock.now) == 2.5
    assert record.rows[1].state == "failed"
    assert record.rows[1].error == "ValueError: learning rate 10.0 is too large"


def test_rows_count_time_from_the_launchs_start_before_their_rank_process_exists():
    clock = Clock()
    record = DashboardRecord(clock)
    record.apply(LaunchStarted(2, "forkserver", "cpu", "no", None))
    clock.now += 3.0  # the kernel imports torch, a forkserver starts: no rank process yet
    assert [(row.state, row.elapsed(clock.now)) for row in record.rows.values()] == [
        ("starting", 3.0)
    ] * 2
    assert views.rows_html(record, clock.now).count(">3.0 s</td>") == 2
    record.apply(RankStarted(0, 1000, "cpu"))
    clock.now += 1.0
    assert (record.rows[0].state, record.rows[0].elapsed(clock.now)) == ("running", 4.0)
    record.apply(LaunchFinished("interrupted", 4.0))
    assert (record.rows[0].state, record.rows[0].elapsed(clock.now)) == ("stopped", 4.0)
    assert (record.rows[1].state, record.rows[1].elapsed(clock.now)) == ("not started", None)


def test_a_restarted_rank_runs_on_with_its_time_moving():
    clock = Clock()
    record = DashboardRecord(clock)
    started(record, clock)
    clock.now += 1.0
    record.apply(RankFinished(1, 1, failure(), "failed"))
    record.apply(GroupRestarting(1, 3, failure(), "restart 1 of 3: rank 1 failed"))
    record.apply(RankStarted(1, 1002, "cpu"))
    clock.now += 2.0
    assert (record.rows[1].state, record.rows[1].elapsed(clock.now)) == ("running", 3.0)
    assert record.notice == "restart 1 of 3: rank 1 failed"


def test_ranks_stopped_by_the_launcher_are_stopped_not_failed():
    record = DashboardRecord(Clock())
    started(record, None)
    record.apply(RankFinished(0, -15, None, "stopped"))
    assert record.rows[0].state == "stopped"


def test_an_interrupted_launch_leaves_no_rank_running():
    record = DashboardRecord(Clock())
    started(record, None)
    record.apply(LaunchFinished("interrupted", 3.0))
    assert {row.state for row in record.rows.values()} == {"stopped"}


def test_a_crash_without_exception_says_how_the_rank_ended():
    killed = RankFailure(1, 1234, -9)
    assert failure_line(killed).startswith("was killed by SIGKILL")
    assert (
        failure_line(RankFailure(0, None, 3)) == "exited with code 3 without raising an exception"
    )


def test_core_progress_wins_over_a_printed_bar_of_the_same_rank():
    record = DashboardRecord(Clock())
    started(record, None)
    record.apply(OutputLine(0, "stderr", " 10%|#         | 10/100 [00:01<00:09, 9.9it/s]", True))
    assert (record.rows[0].progress.n, record.rows[0].progress.total) == (10, 100)
    assert record.rows[0].output_lines == 0  # a redraw is not a line of output
    record.apply(RankProgress(0, 3, 8, "epoch"))
    record.apply(OutputLine(0, "stderr", " 20%|##        | 20/100 [00:02<00:08, 9.9it/s]", True))
    assert record.rows[0].progress.label() == "epoch: 3/8"


def test_a_bars_final_line_counts_as_output_but_not_as_the_last_line():
    record = DashboardRecord(Clock())
    started(record, None)
    final = "100%|##########| 40/40 [00:00<00:00, 97.2it/s]"
    record.apply(OutputLine(1, "stderr", final, False))
    assert record.rows[1].progress.fraction == 1.0
    record.apply(OutputLine(1, "stdout", "epoch 4 done", False))
    record.apply(OutputLine(1, "stderr", final, False))
    assert record.rows[1].last_line == "epoch 4 done"  # the bar shows as progress instead
    assert list(record.rows[1].output) == [f"[stderr] {final}", "epoch 4 done", f"[stderr] {final}"]


def test_metrics_become_one_curve_per_rank_and_metric_bounded_in_size():
    record = DashboardRecord(Clock())
    started(record, None)
    for step in range(3 * POINTS_KEPT):
        record.apply(logged(0, {"loss": 1 / (step + 1), "lr": 0.1}, step))
    record.apply(logged(1, {"loss": 0.5}, None))
    assert set(record.curves) == {("loss", 0), ("lr", 0), ("loss", 1)}
    curve = record.curves[("loss", 0)]
    assert len(curve.values) <= POINTS_KEPT
    steps, _ = curve.points()
    assert steps[0] == 0 and steps[-1] == 3 * POINTS_KEPT - 1  # the whole range
    assert curve.calls == 3 * POINTS_KEPT
    assert list(curve.steps) == sorted(curve.steps)
    assert list(record.curves[("loss", 1)].steps) == [0.0]  # no step given: the call's index


def test_the_text_summary_has_every_rank_state_time_and_error():
    clock = Clock()
    record = DashboardRecord(clock)
    started(record, clock)
    record.apply(OutputLine(0, "stdout", "epoch 4: loss 0.01", False))
    record.apply(logged(0, {"loss": 0.0123456}, 4))
    clock.now += 1.25
    record.apply(RankFinished(1, 1, failure(), "failed"))
    record.apply(RankFinished(0, -15, None, "stopped"))
    record.apply(LaunchFinished("failed", 1.5))
    lines = summary(record, clock.now).splitlines()
    assert lines[0] == "notebook_launcher: 2 x cpu ranks, bf16, fork: failed after 1.5 s"
    assert lines[1].split() == ["rank", "state", "device", "pid", "elapsed", "peak", "memory",
                                "progress", "metrics", "last", "line", "/", "error"]  # fmt: skip
    assert lines[2].split() == ["0", "stopped", "cpu", "1000", "1.2", "s", "-", "-", "loss=0.01235",
                                "epoch", "4:", "loss", "0.01"]  # fmt: skip
    assert lines[3].split()[:5] == ["1", "failed", "cpu", "1001", "1.2"]
    assert lines[3].endswith("ValueError: learning rate 10.0 is too large")


def test_the_html_rows_mark_states_and_highlight_the_failing_rank():
    record = DashboardRecord(Clock())
    started(record, None)
    record.apply(OutputLine(0, "stdout", "<b>not markup</b>", False))
    record.apply(RankProgress(0, 5, 10, ""))
    record.apply(RankFinished(1, 1, failure(), "failed"))
    table = views.rows_html(record, 0.0)
    assert 'class="nl-rank nl-running" data-rank="0"' in table
    assert (
        'class="nl-rank nl-failed" data-rank="1" style="background: rgba(214, 39, 40, 0.12);"'
        in table
    )
    assert "ValueError: learning rate 10.0 is too large" in table
    assert "&lt;b&gt;not markup&lt;/b&gt;" in table and "<b>not markup" not in table
    assert "width: 50.0%" in table and "5/10" in table


def test_the_text_dashboard_prints_status_at_most_once_an_interval_then_the_summary():
    clock, out = Clock(), io.StringIO()
    board = TextDashboard(stream=out, interval=10.0)
    board.record = DashboardRecord(clock)
    board.on_event(LaunchStarted(1, "fork", "cpu", "no", None))
    board.on_event(RankStarted(0, 1000, "cpu"))
    for step in range(1000):  # 1,000 metrics in 25 s
        clock.now += 0.025
        board.on_event(logged(0, {"loss": 1.0 / (step + 1)}, step))
    board.on_event(RankFinished(0, 0, None))
    board.on_event(LaunchFinished("ok", 25.0))
    lines = out.getvalue().splitlines()
    status = [line for line in lines if "rank 0 running" in line]
    assert len(status) == 2, lines
    assert status[0].startswith("notebook_launcher: 10.0 s: rank 0 running - loss=")
    assert lines[-3] == "notebook_launcher: 1 x cpu rank, fp32, fork: finished after 25.0 s"
    assert lines[-1].split()[:3] == ["0", "done", "cpu"]


class Half:
    """A value of the user's own type that Python can add to a float and convert to one."""

    def __radd__(self, other: float) -> float:
        return other + 0.5

    def __float__(self) -> float:
        return 0.5


def metric_streams() -> dict[str, list[RankMetrics]]:
    import math
    import random

    chance = random.Random(7)
    n = 3 * POINTS_KEPT + 11
    plain = [logged(i % 2, {"loss": 1 / (i + 1), "lr": 0.1}, i // 2) for i in range(n)]
    no_step = [logged(i % 3, {"loss": float(i)}, None) for i in range(n)]
    odd_values = (math.nan, math.inf, -math.inf, 3, True, "text", 1e308, 10**400, Half())
    mixed = [
        logged(
            chance.randrange(4),
            {
                **(
                    {"loss": chance.choice(odd_values)}
                    if chance.random() < 0.02
                    else {"loss": chance.random()}
                ),
                **({"val": 0.5} if i % 7 == 0 else {}),
            },
            None if chance.random() < 0.01 else i,
        )
        for i in range(n)
    ]
    # Two names shown alike ("loss" once its colour codes are removed) share one curve.
    alike = [logged(0, {"loss" if i % 3 else "\x1b[31mloss\x1b[0m": float(i)}, i) for i in range(n)]
    # A name made per call: past METRICS_KEPT names, values are counted and not kept. (One
    # rank: which names are the first to reach the kernel depends on how ranks interleave.)
    per_call = [
        logged(0, {"loss": float(i), f"sample_{i}": 1.0}, i) for i in range(METRICS_KEPT + 300)
    ]
    return {
        "plain": plain,
        "no step": no_step,
        "mixed": mixed,
        "alike": alike,
        "per call": per_call,
    }


def kept(record: DashboardRecord) -> str:
    """Everything the record keeps of metrics, NaN included (as text: nan is not nan)."""
    curves = [
        (
            key,
            list(c.steps),
            list(c.values),
            c.calls,
            c.stride,
            c.nonfinite,
            c.nonfinite_calls,
            c.last,
        )
        for key, c in sorted(record.curves.items())
    ]
    rows = [
        (rank, row.state, list(row.last_metrics.items()))
        for rank, row in sorted(record.rows.items())
    ]
    return repr((curves, rows, record.values_not_kept, record.names_not_kept))


@pytest.mark.parametrize("stream", ["plain", "no step", "mixed", "alike", "per call"])
def test_metrics_taken_in_batches_keep_what_one_by_one_keeps(stream):
    events = metric_streams()[stream]
    alone = DashboardRecord(Clock())
    for event in events:
        alone.apply(event)
    for size in (2, 16, 256, 1000, 5000):
        batched = DashboardRecord(Clock())
        for batch in in_batches(events, size):
            batched.apply(batch)
        assert kept(batched) == kept(alone), size


def test_a_metric_name_made_per_call_keeps_a_bounded_record_and_says_what_it_left_out():
    from notebook_launcher.widgets.plot import render_svg
    from notebook_launcher.widgets.static import record_html

    clock = Clock()
    record = DashboardRecord(clock)
    started(record, clock)
    calls = METRICS_KEPT + 5000
    for batch in in_batches(
        metric_streams()["per call"][:2]
        + [logged(0, {"loss": 0.5, f"<b>sample</b>_{i}": 1.0}, i) for i in range(calls)],
        700,
    ):
        record.apply(batch)
    names = {name for name, _ in record.curves}
    assert len(names) == METRICS_KEPT and "loss" in names
    assert record.values_not_kept == calls + 2 - (METRICS_KEPT - 1)
    assert (
        record.rows[0].last_metrics["loss"] == 0.5
        and len(record.rows[0].last_metrics) <= METRICS_KEPT
    )
    note = record.metrics_note()
    assert note is not None and f"past the first {METRICS_KEPT:,}" in note
    assert "<b>sample</b>_" in note and len(record.names_not_kept) == 3
    assert record_data(record)["values_not_kept"] == record.values_not_kept
    page = record_html(record, render_svg(record.shown_curves()))
    assert (
        "&lt;b&gt;sample&lt;/b&gt;_" in page and "were not kept" in page and "<b>sample" not in page
    )


def test_each_rank_peak_memory_is_a_column_of_the_text_html_and_data(monkeypatch):
    monkeypatch.setattr(record_module, "machine_memory", lambda: None)  # shown by the next test
    clock = Clock()
    record = DashboardRecord(clock)
    started(record, clock)
    record.apply(RankMemory(0, "rss", 120_000_000, 100_000_000, "cpu"))
    record.apply(RankMemory(0, "rss", 338_952_192, 330_000_000, "cpu"))  # the peak grew
    record.apply(RankMemory(1, "cuda", 2_400_000_000, 1_000_000_000, "cuda:1"))
    record.apply(RankFinished(0, 0, None))
    record.apply(LaunchFinished("ok", 1.0))
    lines = summary(record, clock.now).splitlines()
    assert lines[2].split()[:8] == ["0", "done", "cpu", "1000", "0.0", "s", "339", "MB"]
    assert "2.4 GB cuda" in lines[3]
    table = views.rows_html(record, clock.now)
    assert ">peak memory</th>" in table
    assert 'title="peak resident memory (RSS) on cpu"' in table and ">339 MB</span>" in table
    assert (
        'title="peak CUDA memory allocated on cuda:1"' in table and ">2.4 GB cuda</span>" in table
    )
    lasting = record_html(record, None)  # what a saved notebook keeps
    assert ">peak memory</th>" in lasting and '<span class="nl-memory">339 MB</span>' in lasting
    ranks = record_data(record)["ranks"]
    assert ranks[0]["peak_memory"] == {
        "kind": "rss",
        "peak_bytes": 338_952_192,
        "current_bytes": 330_000_000,
        "device": "cpu",
        "rss_bytes": None,
    }
    assert ranks[1]["peak_memory"]["kind"] == "cuda"


def test_the_machine_ram_in_use_shows_beside_each_rank_and_warns_past_85_percent(monkeypatch):
    readings = iter([MachineMemory(12 * 10**9, 24 * 10**9), MachineMemory(21 * 10**9, 24 * 10**9)])
    monkeypatch.setattr(record_module, "machine_memory", lambda: next(readings))
    clock = Clock()
    record = DashboardRecord(clock)
    started(record, clock)
    record.apply(RankMemory(0, "rss", 338_952_192, 330_000_000, "cpu", 330_000_000))
    lines = summary(record, clock.now).splitlines()
    assert "339 MB · RAM 50%" in lines[2]
    assert not any("OOM killer" in line for line in lines)
    clock.now += 2  # read again at most once a second
    # A GPU rank: its CUDA peak, and its resident memory beside the machine's.
    record.apply(RankMemory(1, "cuda", 2_400_000_000, 1_000_000_000, "cuda:1", 3_100_000_000))
    lines = summary(record, clock.now).splitlines()
    assert "2.4 GB cuda, 3.1 GB RSS · ⚠ RAM 88%" in lines[3]
    assert lines[4] == (
        "The machine's RAM 21 GB of 24 GB (88%) is in use: a rank that needs more is killed by "
        "the kernel's OOM killer. Load the model once per machine (main_process_first), in a "
        "smaller dtype, or use fewer ranks."
    )
    assert "nl-ram-warning" in views.header_html(record, clock.now)
    assert "color: #d62728;" in views.rows_html(record, clock.now)
    assert record_data(record)["machine_memory"] == {
        "used_bytes": 21 * 10**9,
        "total_bytes": 24 * 10**9,
    }


def test_the_machine_ram_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:    6000000 kB\n")
    machine = machine_memory(str(meminfo))
    assert machine == MachineMemory(18_000_000 * 1024, 24_000_000 * 1024)
    assert machine.share == 0.75 and not machine.warning
    assert machine_memory(str(tmp_path / "absent")) is None


def test_a_rank_that_never_reported_memory_shows_a_dash():
    record = DashboardRecord(Clock())
    started(record, None, ranks=1)
    assert record_data(record)["ranks"][0]["peak_memory"] is None
    assert summary(record, 0.0).splitlines()[2].split()[6] == "-"  # after "elapsed" (2 words)
