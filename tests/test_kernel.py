"""What a notebook user sees: launches from a real Jupyter kernel."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.conftest import rank_processes
from tests.support.kernel_driver import RunningKernel

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def kernel():
    running = RunningKernel()
    setup = running.run(
        """
        import os, time
        from notebook_launcher import notebook_launcher
        GREETING = "hello from"
        def describe(rank):
            return f"{GREETING} rank {rank}"
        """
    )
    assert setup.error is None, setup.error
    yield running
    running.shutdown()


def assert_no_ranks_left(kernel_pid: int, within_s: float = 120.0) -> None:
    deadline = time.monotonic() + within_s
    while rank_processes(kernel_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rank_processes(kernel_pid) == []


def wait_for_lines(kernel: RunningKernel, msg_id: str, text: str, count: int) -> None:
    """Until the running cell printed ``text`` ``count`` times (each rank once)."""
    seen = ""
    while seen.count(text) < count:
        seen += kernel.collect(msg_id, until=text).stdout


def test_each_ranks_output_appears_in_the_cell_with_its_rank(kernel):
    cell = kernel.run(
        """
        def train(x):
            rank = int(os.environ["RANK"])
            print(describe(rank), flush=True)
            return x * 10 + rank
        notebook_launcher(train, args=(4,), num_processes=2)
        """
    )
    assert cell.error is None, cell.error
    assert "[rank0]: hello from rank 0\n" in cell.stdout
    assert "[rank1]: hello from rank 1\n" in cell.stdout
    assert cell.result == "40"
    assert_no_ranks_left(kernel.pid)


def test_all_values_come_back_with_return_all(kernel):
    cell = kernel.run(
        "notebook_launcher(lambda: int(os.environ['RANK']) ** 2, num_processes=2, return_all=True)"
    )
    assert cell.error is None and cell.result == "[0, 1]"


def test_a_failing_rank_shows_its_own_traceback_in_the_cell_and_rerun_works(kernel):
    failing = """
        def flaky(lr):
            if os.environ["RANK"] == "1":
                raise ValueError(f"lr={lr} diverged")
            time.sleep(60)
        try:
            notebook_launcher(flaky, args=(3.0,), num_processes=2)
        except ValueError as error:
            print("caught as ValueError")
            raise
        """
    for _ in range(3):
        cell = kernel.run(failing)
        assert "caught as ValueError" in cell.stdout
        assert cell.error["ename"] == "RankFailedError[ValueError]"
        assert cell.error["evalue"].startswith("Rank 1 (pid ")
        assert "raised ValueError: lr=3.0 diverged" in cell.error["evalue"]
        assert "Traceback from rank 1:" in cell.error["evalue"]
        assert 'raise ValueError(f"lr={lr} diverged")' in cell.error["evalue"]
        assert_no_ranks_left(kernel.pid)
        rerun = kernel.run("notebook_launcher(describe, args=(7,), num_processes=2)")
        assert rerun.error is None and rerun.result == "'hello from rank 7'"


def test_interrupting_the_kernel_stops_every_rank(kernel):
    msg_id = kernel.submit(
        """
        def wait_forever():
            print("rank", os.environ["RANK"], "waiting", flush=True)
            time.sleep(600)
        notebook_launcher(wait_forever, num_processes=2)
        """
    )
    wait_for_lines(kernel, msg_id, "waiting", 2)
    ranks = rank_processes(kernel.pid)
    assert len(ranks) == 2
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id)
    assert cell.error["ename"] == "KeyboardInterrupt"
    assert_no_ranks_left(kernel.pid)
    again = kernel.run("notebook_launcher(describe, args=(1,), num_processes=2)")
    assert again.error is None


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_ranks_do_not_outlive_a_dead_kernel(method):
    doomed = RunningKernel()
    try:
        msg_id = doomed.submit(
            f"""
            import os, time
            from notebook_launcher import notebook_launcher
            def wait_forever():
                print("waiting", flush=True)
                time.sleep(600)
            notebook_launcher(wait_forever, num_processes=2, start_method={method!r})
            """
        )
        wait_for_lines(doomed, msg_id, "waiting", 2)
        assert len(rank_processes(doomed.pid)) == 2
        # The forkserver and the resource tracker must go too, not only the ranks.
        everything = psutil.Process(doomed.pid).children(recursive=True)
        os.kill(doomed.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(everything, timeout=120)  # a safety net: they die at once
        assert alive == [], f"processes survived their kernel: {alive}"
    finally:
        doomed.shutdown()


def test_an_exception_class_defined_in_a_cell_is_caught_under_fork(kernel):
    cell = kernel.run(
        """
        class DataProblem(Exception):
            pass
        def bad_shard():
            raise DataProblem("shard 3 is empty")
        for method in ("fork", "forkserver"):
            try:
                notebook_launcher(bad_shard, num_processes=1, start_method=method)
            except DataProblem as error:
                print(method, "caught", isinstance(error, DataProblem))
        """
    )
    assert cell.error is None, cell.error
    assert cell.stdout.splitlines() == ["fork caught True", "forkserver caught True"]


def test_input_in_a_rank_fails_at_once_even_where_the_frontend_answers_input(kernel):
    assert kernel.client.allow_stdin  # this frontend would show a prompt for the kernel's input()
    cell = kernel.run(
        """
        notebook_launcher(lambda: input("learning rate? "), num_processes=1, timeout=60)
        """
    )
    assert cell.error["ename"] == "RankFailedError[RankInputError]"
    assert "input() (prompt 'learning rate? ') cannot be used in a rank" in cell.error["evalue"]


def test_a_daemon_of_a_rank_is_ended_by_the_next_listing_after_its_kernel_was_killed(tmp_path):
    from notebook_launcher import registry

    doomed = RunningKernel()
    try:
        msg_id = doomed.submit(
            """
            import subprocess, time
            from notebook_launcher import notebook_launcher
            def start_a_daemon_then_wait():
                daemon = subprocess.Popen(["sleep", "304"], start_new_session=True)
                print("daemon", daemon.pid, flush=True)
                time.sleep(600)
            notebook_launcher(start_a_daemon_then_wait, num_processes=1)
            """
        )
        # The launcher prints a rank's lines whole: the pid comes with the word.
        cell = doomed.collect(msg_id, until="daemon ")
        daemon = psutil.Process(int(cell.stdout.split("daemon ", 1)[1].split()[0]))
        ranks = psutil.Process(doomed.pid).children()  # and the forkserver, say: all die with it
        os.kill(doomed.pid, signal.SIGKILL)
        psutil.wait_procs(ranks, timeout=120)  # the ranks die with their kernel at once
        assert daemon.is_running()  # in a session of its own, nobody ended it so far
        # What the sidebar's listing (or the next launch on this machine) does.
        assert all(r.kernel_pid != doomed.pid for r in registry.list_launches())
        daemon.wait(timeout=120)  # a safety net: it was sent SIGKILL by the listing
    finally:
        doomed.shutdown()
