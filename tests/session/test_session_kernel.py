"""What a notebook user sees of a session, in a real Jupyter kernel."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.conftest import rank_processes
from tests.support.kernel_driver import RunningKernel, run_ok, wait_for_output, with_session

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def kernel():
    yield from with_session()


def test_state_stays_on_the_ranks_across_three_cells_with_prefixed_output_and_values(kernel):
    run_ok(kernel, "%%distributed\nsteps = [rank]")
    run_ok(kernel, "%%distributed\nsteps.append(rank * 10)\nprint('steps so far', steps)")
    cell = run_ok(kernel, "%%distributed\nsteps.append(rank * 100)\nsteps")
    assert cell.result == "[rank0]: [0, 0, 0]\n[rank1]: [1, 10, 100]"
    second = kernel.run("%%distributed\nprint('line one', flush=True)\nprint('line two')")
    assert "[rank0]: line one\n" in second.stdout and "[rank1]: line two\n" in second.stdout


def test_output_arrives_while_the_cell_still_runs(kernel, tmp_path):
    go_on = tmp_path / "go-on"
    msg_id = kernel.submit(
        "%%distributed\nimport os, time\nprint('early', flush=True)\n"
        f"while not os.path.exists({str(go_on)!r}):\n    time.sleep(0.02)\nprint('late')"
    )
    seen = kernel.collect(msg_id, until="early")
    assert "late" not in seen.stdout  # the ranks wait for the file: the line came live
    go_on.touch()
    rest = kernel.collect(msg_id)
    assert rest.error is None and "[rank1]: late\n" in rest.stdout


def test_notebook_names_go_to_the_ranks_and_return_brings_names_back(kernel):
    run_ok(kernel, "WIDTH = 4\ndef make(n):\n    return list(range(n))")
    run_ok(kernel, "%%distributed --return shard\nshard = make(WIDTH)[rank::world_size]")
    assert run_ok(kernel, "shard").result == "[0, 2]"


def test_a_failure_on_one_rank_while_the_other_waits_in_all_reduce_raises_and_the_next_cell_works(
    kernel,
):
    cell = kernel.run(
        "%%distributed\n"
        "t = torch.ones(8)\n"
        "if rank == 1:\n"
        "    raise RuntimeError('rank 1 lost its data')\n"
        "torch.distributed.all_reduce(t)\n",
        timeout=600,  # a safety net: it ends in seconds
    )
    assert cell.error["ename"] == "RankFailedError[RuntimeError]"
    assert cell.error["evalue"].startswith("Rank 1 (pid ")
    assert "raised RuntimeError: rank 1 lost its data" in cell.error["evalue"]
    assert "Rank(s) 0 were still running the cell and were interrupted." in cell.error["evalue"]
    assert ", line 4, in <module>" in cell.error["evalue"]
    after = run_ok(
        kernel, "%%distributed\nt = torch.ones(8)\ntorch.distributed.all_reduce(t)\nt.sum().item()"
    )
    assert after.result == "[rank0]: 16.0\n[rank1]: 16.0"


def test_the_stop_button_interrupts_both_sleeping_ranks_and_the_session_survives(kernel):
    msg_id = kernel.submit(
        "%%distributed\nimport time\nprint('sleeping', flush=True)\ntime.sleep(600)"
    )
    seen = kernel.collect(msg_id, until="sleeping")
    while seen.stdout.count("sleeping") < 2:
        seen.stdout += kernel.collect(msg_id, until="sleeping").stdout
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id, timeout=600)  # a safety net: it ends in seconds
    assert cell.error["ename"] == "KeyboardInterrupt"
    assert "the cell was interrupted on rank(s) 0, 1" in cell.error["evalue"]
    assert run_ok(kernel, "%%distributed\nrank + 1").result == "[rank0]: 1\n[rank1]: 2"


def test_the_stop_button_wakes_a_rank_whose_interrupt_landed_on_another_thread(kernel):
    # Linux may hand the process's SIGINT to any thread that does not block it; blocking it
    # in the main thread makes it land elsewhere every time, while the main thread sleeps.
    msg_id = kernel.submit(
        "%%distributed\nimport signal, time\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
        "try:\n    print('sleeping', flush=True)\n    time.sleep(600)\n"
        "finally:\n    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})"
    )
    wait_for_output(kernel, msg_id, ["[rank0]: sleeping", "[rank1]: sleeping"])
    kernel.manager.interrupt_kernel()
    stuck = "did not stop within"  # what the kernel says when a rank is not back 5 s later
    cell = kernel.collect(
        msg_id, timeout=120, until_stderr=stuck
    )  # a safety net: it ends in a second
    if stuck in cell.stderr:  # a second press ends the session, and the cell, at once
        kernel.manager.interrupt_kernel()
        kernel.collect(msg_id)
        run_ok(kernel, "%distributed restart")
    assert stuck not in cell.stderr, cell.stderr
    assert cell.error["ename"] == "KeyboardInterrupt", cell
    assert "the cell was interrupted on rank(s) 0, 1" in cell.error["evalue"]
    assert run_ok(kernel, "%%distributed\nrank + 1").result == "[rank0]: 1\n[rank1]: 2"


def wait_until_ended(pid: int) -> None:
    """Until the process is gone or a zombie the kernel can reap when it next looks.

    A process's main thread shows as a zombie while its other threads are still exiting,
    and it cannot be reaped until they are gone: wait for those too."""
    try:
        process = psutil.Process(pid)
        deadline = time.monotonic() + 300  # a safety net only
        while time.monotonic() < deadline and not (
            process.status() == psutil.STATUS_ZOMBIE and process.num_threads() <= 1
        ):
            time.sleep(0.02)
    except psutil.NoSuchProcess:
        pass


def test_a_rank_killed_between_cells_is_named_in_the_next_cell_and_restart_works(kernel):
    status = run_ok(kernel, "%distributed status").stdout
    pids = [
        int(pid) for pid in status.split("(pids ")[1].split(")")[0].split(", ")
    ]  # in rank order
    assert sorted(pids) == sorted(p.pid for p in rank_processes(kernel.pid))
    victim = pids[1]
    os.kill(victim, signal.SIGKILL)
    wait_until_ended(victim)
    status = run_ok(kernel, "%distributed status")
    assert "stopped:" in status.stdout and "SIGKILL" in status.stdout, status
    cell = kernel.run("%%distributed\nrank")
    assert cell.error["ename"] == "SessionError"
    assert f"Rank 1 (pid {victim}) was killed by SIGKILL" in cell.error["evalue"]
    assert "%distributed restart" in cell.error["evalue"]
    run_ok(kernel, "%distributed restart")
    assert run_ok(kernel, "%%distributed\nworld_size").result == "[rank0]: 2\n[rank1]: 2"


def test_ranks_do_not_outlive_a_killed_kernel():
    doomed = RunningKernel()
    try:
        setup = doomed.run("%load_ext notebook_launcher\n%distributed start -n 2 --hardware cpu")
        assert setup.error is None, setup.error
        everything = psutil.Process(doomed.pid).children(recursive=True)
        assert len(rank_processes(doomed.pid)) == 2
        os.kill(doomed.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(everything, timeout=300)  # returns as soon as all are gone
        assert alive == [], f"processes survived their kernel: {alive}"
    finally:
        doomed.shutdown()
