"""The stop button keeps working whatever a cell did to the ranks' signals and groups, and
whoever drove the session before (a cell or a widget's callback), in a real Jupyter kernel."""

from __future__ import annotations

import pytest

from tests.support.kernel_driver import (
    CellRun,
    RunningKernel,
    run_ok,
    wait_for_output,
    with_session,
)

pytestmark = pytest.mark.kernel

# What the kernel says when a rank is not back 5 s after the interrupt.
STUCK = "did not stop within"

# Rank 0 waits in an all_reduce that rank 1 never joins; each says so first.
RANK_0_IN_A_COLLECTIVE = (
    "%%distributed\n"
    "import time\n"
    "t = torch.ones(4)\n"
    "if rank == 0:\n"
    "    print('waiting', flush=True)\n"
    "    torch.distributed.all_reduce(t{group})\n"
    "else:\n"
    "    print('sleeping', flush=True)\n"
    "    time.sleep(600)\n"
)


@pytest.fixture
def kernel():
    yield from with_session()


def stop(kernel: RunningKernel, msg_id: str, texts: list[str]) -> CellRun:
    """Press stop once the cell showed ``texts``; the cell as it ended. A cell whose ranks
    do not come back is ended with a second press, so the test fails on what it saw."""
    wait_for_output(kernel, msg_id, texts)
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id, timeout=300, until_stderr=STUCK)  # a safety net
    if STUCK in cell.stderr:
        kernel.manager.interrupt_kernel()
        kernel.collect(msg_id)
    assert STUCK not in cell.stderr, cell.stderr
    assert cell.error is not None and cell.error["ename"] == "KeyboardInterrupt", cell
    return cell


def stop_sleeping_ranks(kernel: RunningKernel) -> CellRun:
    msg_id = kernel.submit(
        "%%distributed\nimport time\nprint('sleeping', flush=True)\ntime.sleep(600)"
    )
    return stop(kernel, msg_id, ["[rank0]: sleeping", "[rank1]: sleeping"])


def test_a_cell_that_installs_its_own_sigint_handler_is_warned_and_the_next_cell_still_stops(
    kernel,
):
    own = run_ok(
        kernel,
        "%%distributed\nimport signal\n"
        "signal.signal(signal.SIGINT, lambda signum, frame: print('mine', flush=True))",
    )
    cell = stop_sleeping_ranks(kernel)
    assert "the cell was interrupted on rank(s) 0, 1" in cell.error["evalue"]
    assert "the cell replaced the handler of SIGINT" in own.stderr, own
    assert "[rank1]: notebook_launcher: " in own.stderr
    assert "mine" not in cell.stdout  # the rank's own handler is back
    assert run_ok(kernel, "%%distributed\nrank + 1").result == "[rank0]: 1\n[rank1]: 2"


def test_after_an_asyncio_loop_with_a_signal_handler_closed_a_rank_in_a_collective_is_stopped(
    kernel,
):
    loop = run_ok(
        kernel,
        "%%distributed\nimport asyncio, signal\n"
        "async def main():\n"
        "    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, lambda: None)\n"
        "asyncio.run(main())",
    )
    msg_id = kernel.submit(RANK_0_IN_A_COLLECTIVE.format(group=""))
    cell = stop(kernel, msg_id, ["[rank0]: waiting", "[rank1]: sleeping"])
    assert "the wake-up descriptor" in loop.stderr, loop
    assert "the cell was interrupted on rank(s) 0, 1" in cell.error["evalue"]
    after = run_ok(
        kernel, "%%distributed\nt = torch.ones(2)\ntorch.distributed.all_reduce(t)\nt.sum().item()"
    )
    assert after.result == "[rank0]: 4.0\n[rank1]: 4.0"


def test_a_collective_on_a_new_group_is_stopped_and_that_group_and_the_default_work_afterwards(
    kernel,
):
    run_ok(kernel, "%%distributed\npair = torch.distributed.new_group([0, 1])")
    msg_id = kernel.submit(RANK_0_IN_A_COLLECTIVE.format(group=", group=pair"))
    cell = stop(kernel, msg_id, ["[rank0]: waiting", "[rank1]: sleeping"])
    assert "the process group was rebuilt" in cell.error["evalue"], cell.error
    after = run_ok(
        kernel,
        "%%distributed\n"
        "t, u = torch.ones(2), torch.ones(3)\n"
        "torch.distributed.all_reduce(t, group=pair)\n"
        "torch.distributed.all_reduce(u)\n"
        "(t.sum().item(), u.sum().item())",
    )
    assert after.result == "[rank0]: (4.0, 6.0)\n[rank1]: (4.0, 6.0)"


def test_a_slow_call_that_is_not_a_collective_keeps_the_group_for_the_cells_own_cleanup(kernel):
    # The main thread blocks the signals that would wake it, so its sleep comes back to
    # Python only when it ends: slow, but waiting for no peer. The cell catches the
    # interrupt and runs a collective of its own, which needs the group whole.
    msg_id = kernel.submit(
        "%%distributed\nimport signal, time\n"
        "wake = {signal.SIGINT, signal.SIGRTMIN}\n"
        "try:\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, wake)\n"
        "    print('sleeping', flush=True)\n"
        "    try:\n        time.sleep(8)\n"
        "    finally:\n        signal.pthread_sigmask(signal.SIG_UNBLOCK, wake)\n"
        "    time.sleep(600)\n"
        "except KeyboardInterrupt:\n"
        "    t = torch.ones(1)\n"
        "    torch.distributed.all_reduce(t)\n"
        "    print('cleaned up with', t.item(), flush=True)\n"
    )
    wait_for_output(kernel, msg_id, ["[rank0]: sleeping", "[rank1]: sleeping"])
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id, timeout=300)  # a safety net: it ends when the sleeps do
    assert "[rank0]: cleaned up with 2.0" in cell.stdout, cell
    assert "[rank1]: cleaned up with 2.0" in cell.stdout, cell
    assert cell.error["ename"] == "KeyboardInterrupt", cell
    assert "rebuilt" not in cell.error["evalue"], cell.error
    assert run_ok(kernel, "%%distributed\nrank + 1").result == "[rank0]: 1\n[rank1]: 2"


def click(kernel: RunningKernel, model_id: str) -> str:
    """What the frontend sends when a Button is clicked; the message's id."""
    content = {"comm_id": model_id, "data": {"method": "custom", "content": {"event": "click"}}}
    message = kernel.client.session.msg("comm_msg", content)
    kernel.client.shell_channel.send(message)
    return message["header"]["msg_id"]


def test_after_a_widget_callback_was_stopped_the_stop_button_still_stops_the_next_cells_ranks(
    kernel,
):
    made = run_ok(
        kernel,
        "import ipywidgets\n"
        "session = get_ipython().magics_manager.registry['DistributedMagics'].session\n"
        "outcome = []\n"
        "def clicked(_):\n"
        "    try:\n"
        "        session.execute(\"import time\\nprint('sleeping', flush=True)\\ntime.sleep(600)\")\n"
        "    except KeyboardInterrupt as error:\n"
        "        outcome.append(str(error))\n"
        "button = ipywidgets.Button(description='go')\n"
        "button.on_click(clicked)\n"
        "print(button.model_id)",
    )
    msg_id = click(kernel, made.stdout.strip())
    wait_for_output(kernel, msg_id, ["[rank0]: sleeping", "[rank1]: sleeping"])
    kernel.manager.interrupt_kernel()
    kernel.collect(msg_id, timeout=300)  # a safety net: the callback ends in a second
    # No cell ran around the callback: nothing but the session itself can let go of the
    # handler that counted later presses.
    msg_id = kernel.submit(
        "%%distributed\nimport time\nprint('sleeping', flush=True)\ntime.sleep(600)"
    )
    wait_for_output(kernel, msg_id, ["[rank0]: sleeping", "[rank1]: sleeping"])
    kernel.manager.interrupt_kernel()
    try:
        cell = kernel.collect(msg_id, timeout=120)  # a safety net: it ends in a second
    except TimeoutError:
        kernel.manager.shutdown_kernel(now=True)  # the cell would sleep on
        pytest.fail("the stop button did not stop the cell's ranks")
    assert cell.error["ename"] == "KeyboardInterrupt", cell
    assert "the cell was interrupted on rank(s) 0, 1" in cell.error["evalue"]
    assert "interrupted on rank(s) 0, 1" in run_ok(kernel, "outcome").result  # the callback's
    assert run_ok(kernel, "%%distributed\nrank + 1").result == "[rank0]: 1\n[rank1]: 2"
