"""A session as people press, print and pass things in a real Jupyter kernel."""

from __future__ import annotations

import ast
import time

import psutil
import pytest

from tests.conftest import rank_processes
from tests.support.kernel_driver import RunningKernel, run_ok, with_session

pytestmark = pytest.mark.kernel

# Rank 0 waits in an all_reduce that rank 1 never joins; each says so first.
WAITING_IN_A_COLLECTIVE = (
    "%%distributed\n"
    "import time\n"
    "print('waiting', flush=True)\n"
    "if rank == 0:\n"
    "    torch.distributed.all_reduce(torch.ones(8))\n"
    "else:\n"
    "    time.sleep(600)\n"
)


@pytest.fixture(scope="module")
def kernel():
    yield from with_session()


def wait_for_both(kernel, msg_id: str, text: str) -> None:
    seen = kernel.collect(msg_id, until=text)
    while seen.stdout.count(text) < 2:
        seen.stdout += kernel.collect(msg_id, until=text).stdout


@pytest.mark.parametrize("apart_s", [0.05, 0.1, 0.15, 0.6])
def test_stop_pressed_twice_during_a_collective_ends_the_cell_with_one_message_and_keeps_the_session(
    kernel, apart_s
):
    run_ok(kernel, "%%distributed\nkept = rank * 7")
    msg_id = kernel.submit(WAITING_IN_A_COLLECTIVE)
    wait_for_both(kernel, msg_id, "waiting")
    kernel.manager.interrupt_kernel()
    time.sleep(apart_s)  # how far apart a person presses; not a wait for the program
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id, timeout=600)  # a safety net: it ends in seconds
    assert cell.error is not None
    assert cell.error["ename"] == "KeyboardInterrupt"
    assert cell.error["evalue"].startswith(
        "the cell was interrupted on rank(s) 0, 1; the process group was rebuilt; the session is "
        "ready for the next cell.\nWhere each rank was when it was stopped:\nrank 0: cell "
    )
    assert cell.error["traceback"] == [f"KeyboardInterrupt: {cell.error['evalue']}"]
    assert "Traceback" not in cell.stderr and "selectors" not in cell.stderr
    after = run_ok(
        kernel,
        "%%distributed\nt = torch.ones(2) * kept\ntorch.distributed.all_reduce(t)\nt.tolist()",
    )
    assert after.result == "[rank0]: [7.0, 7.0]\n[rank1]: [7.0, 7.0]"


def test_a_last_value_or_a_returned_name_that_cannot_be_pickled_shows_the_ranks_repr(kernel):
    cell = run_ok(kernel, "%%distributed\nimport threading\nL = threading.Lock()\nL")
    assert cell.result is not None
    assert cell.result.startswith("[rank0]: <unlocked _thread.lock object at 0x")
    assert "\n[rank1]: <unlocked _thread.lock object at 0x" in cell.result
    returned = run_ok(kernel, "%%distributed --return L\nL = threading.Lock()")
    assert "notebook_launcher: L set in the notebook from rank 0." in returned.stderr
    assert run_ok(kernel, "L").result.startswith("<unlocked _thread.lock object at 0x")


def test_output_without_a_final_newline_lands_in_its_own_cell(kernel):
    first = run_ok(kernel, "%%distributed\nprint(f'partial {rank}', end='')")
    for rank in (0, 1):
        assert f"[rank{rank}]: partial {rank}\n" in first.stdout
    bar = run_ok(kernel, "%%distributed\nprint('\\rprogress 50%', end='')")
    assert "partial" not in bar.stdout and "progress 50%" in bar.stdout
    second = run_ok(kernel, "%%distributed\nprint('next cell')")
    assert "progress" not in second.stdout and "[rank0]: next cell\n" in second.stdout
    big = run_ok(kernel, "%%distributed --ranks 0\nprint('x' * 20_000_000, end='')")
    assert big.stdout.count("x") >= 20_000_000
    assert "x" not in run_ok(kernel, "%%distributed --ranks 0\nprint('after')").stdout


def test_a_notebook_value_that_cannot_be_pickled_is_not_needed_when_the_cell_assigns_it_first(
    kernel,
):
    run_ok(kernel, "def numbers():\n    yield 1\ngen = numbers()")
    read_first = kernel.run("%%distributed\nnext(gen)")
    assert read_first.error["ename"] == "LaunchConfigError"
    assert (
        "the cell uses the notebook's 'gen' (a builtins.generator), which cannot be sent"
        in read_first.error["evalue"]
    )
    assert run_ok(kernel, "%%distributed\ngen = 5\ngen + rank").result == "[rank0]: 5\n[rank1]: 6"


def test_a_syntax_error_names_the_cells_own_line_and_starts_no_session():
    fresh = RunningKernel()
    try:
        run_ok(fresh, "%load_ext notebook_launcher")
        cell = fresh.run("%%distributed\nx = 1\ny = (\n")
        assert cell.error["ename"] == "DistributedUsageError"
        shown = "\n".join(cell.error["traceback"])
        assert shown.startswith(
            "DistributedUsageError: %%distributed: the cell has a syntax error, so it was not sent "
            'to the ranks:\n  File "In['
        ), shown
        assert "line 3\n    y = (\n" in shown and "SyntaxError: '(' was never closed" in shown
        assert "site-packages" not in shown and "notebook_launcher/" not in shown
        assert "started a session" not in cell.stderr
        assert "no session" in run_ok(fresh, "%distributed status").stdout
        assert rank_processes(fresh.pid) == []
    finally:
        fresh.shutdown()


def test_magics_and_shell_commands_in_a_cell_are_refused_by_name(kernel):
    cell = kernel.run("%%distributed\nx = 1\n%time y = 2\n")
    assert cell.error["ename"] == "DistributedUsageError"
    assert cell.error["evalue"].startswith(
        "%%distributed: line 3 (%time y = 2) is IPython syntax (a magic, a shell command or help), "
        "which the ranks cannot run"
    )
    shell = kernel.run("%%distributed\n!ls\n")
    assert "%%distributed: line 2 (!ls) is IPython syntax" in shell.error["evalue"]
    # IPython's other transformations still apply: an indented cell runs.
    assert run_ok(kernel, "%%distributed\n    a = rank\n    a").result == "[rank0]: 0\n[rank1]: 1"


def test_exit_in_a_rank_is_the_interpreters_exit(kernel):
    cell = kernel.run("%%distributed\nif rank == 1:\n    exit()\n")
    assert cell.error["ename"] == "RankFailedError"
    assert "Rank 1 (pid " in cell.error["evalue"] and "raised SystemExit" in cell.error["evalue"]
    assert "NameError" not in cell.error["evalue"]
    assert run_ok(kernel, "%%distributed\nrank").result == "[rank0]: 0\n[rank1]: 1"
    launched = run_ok(
        kernel,
        "from notebook_launcher import debug_launcher\n"
        "def leave():\n    print('leaving', flush=True)\n    exit()\n"
        "debug_launcher(leave, num_processes=1)",
    )
    assert "leaving" in launched.stdout


def test_ranks_hold_none_of_the_kernels_listening_sockets(kernel):
    kernel_ports = {
        c.laddr.port
        for c in psutil.Process(kernel.pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    }
    assert kernel_ports  # the kernel's ZMQ ports and the session's store
    ranks = rank_processes(kernel.pid)
    assert len(ranks) == 2
    for rank in ranks:
        held = {
            c.laddr.port for c in rank.net_connections("inet") if c.status == psutil.CONN_LISTEN
        }
        assert not held & kernel_ports, (
            f"rank {rank.pid} holds the kernel's ports {held & kernel_ports}"
        )
    # A launch's ranks start the same way.
    launched = run_ok(
        kernel,
        "import psutil\nfrom notebook_launcher import debug_launcher\n"
        "def listening():\n"
        "    return sorted(c.laddr.port for c in psutil.Process().net_connections('inet') if c.status == 'LISTEN')\n"
        "held_by_rank = debug_launcher(listening, num_processes=1)\nheld_by_rank",
    )
    held = set(ast.literal_eval(launched.result))  # the list of port numbers the kernel shows
    assert not held & kernel_ports, (
        f"a launched rank holds the kernel's ports {held & kernel_ports}"
    )
