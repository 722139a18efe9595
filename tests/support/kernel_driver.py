"""Driving a real IPython kernel the way a notebook frontend does (jupyter_client)."""

from __future__ import annotations

import dataclasses
import queue
import textwrap
import time
from collections.abc import Iterator
from typing import Any

from jupyter_client.manager import KernelManager


@dataclasses.dataclass
class CellRun:
    stdout: str = ""
    stderr: str = ""
    result: str | None = None
    error: dict | None = None  # ename, evalue, traceback
    messages: list[dict] = dataclasses.field(default_factory=list)  # every iopub message, in order


# jupyter_client picks a kernel's ports by binding port 0 and letting go: another process
# starting a kernel meanwhile may be handed the same port, and the kernel that binds second
# dies at once ("Address already in use"). On a machine running two suites at once, tries
# again with fresh ports.
_KERNEL_START_TRIES = 3


def started_kernel(connection_file: str | None = None, **start: Any) -> KernelManager:
    """A python3 kernel that answered kernel_info (``start``: start_kernel's arguments,
    such as ``cwd``); for nbclient, pass it as ``km=`` and shut it down after."""
    for attempt in range(1, _KERNEL_START_TRIES + 1):
        manager = KernelManager(kernel_name="python3")
        if connection_file is not None:
            manager.connection_file = connection_file
        manager.start_kernel(**start)
        client = manager.client()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=600)
            return manager
        except RuntimeError:  # "Kernel died before replying to kernel_info"
            manager.shutdown_kernel(now=True)
            manager.cleanup_resources()
            if attempt == _KERNEL_START_TRIES:
                raise
        finally:
            client.stop_channels()
    raise AssertionError("unreachable")


def execute_notebook(notebook: Any, cwd: str, **options: Any) -> None:
    """Runs ``notebook`` with nbclient (``options``: its own) in a kernel started in ``cwd``
    by :func:`started_kernel`, which is shut down after."""
    from nbclient import NotebookClient

    kernel = started_kernel(cwd=cwd)
    try:
        NotebookClient(
            notebook, km=kernel, resources={"metadata": {"path": cwd}}, **options
        ).execute()
    finally:
        kernel.shutdown_kernel(now=True)


_ALIVE_CHECK_S = 5  # how often a cell's wait looks whether the kernel is still alive


class RunningKernel:
    def __init__(self) -> None:
        self.manager = started_kernel()
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=600)

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid  # type: ignore[union-attr]

    def run(self, code: str, timeout: float = 600) -> CellRun:
        return self.collect(self.submit(code), timeout)

    def submit(self, code: str) -> str:
        # Each cell stands alone. With stop_on_error, a cell that raised sets the kernel
        # aborting until its event loop's next turn, and a cell sent at once after the error
        # (as the next test line does) may be aborted unrun: ipykernel answers it with an idle
        # status alone, seen on a busy machine as an empty result or a wait for output.
        return self.client.execute(textwrap.dedent(code), stop_on_error=False)

    def collect(
        self,
        msg_id: str,
        timeout: float = 600,
        until: str | None = None,
        until_message: str | None = None,
        until_stderr: str | None = None,
    ) -> CellRun:
        """Gather the cell's outputs until it is idle (or until ``until`` appears in stdout,
        ``until_stderr`` in stderr, or a message of the kind ``until_message`` arrives)."""
        cell = CellRun()
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"cell did not finish in {timeout}s; so far: {cell}")
            try:
                # In slices: a kernel that died sends nothing more, and is named at once.
                message = self.client.get_iopub_msg(timeout=min(remaining, _ALIVE_CHECK_S))
            except queue.Empty:
                if not self.manager.is_alive():
                    raise AssertionError(
                        f"the kernel (pid {self.pid}) died while the cell ran, exit status "
                        f"{self.manager.provisioner.process.poll()}; so far: {cell}"  # type: ignore[union-attr]
                    ) from None
                continue
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            cell.messages.append(message)
            if kind == until_message:
                return cell
            if kind == "stream":
                if content["name"] == "stdout":
                    cell.stdout += content["text"]
                else:
                    cell.stderr += content["text"]
                if until is not None and until in cell.stdout:
                    return cell
                if until_stderr is not None and until_stderr in cell.stderr:
                    return cell
            elif kind == "execute_result":
                cell.result = content["data"].get("text/plain")
            elif kind == "error":
                cell.error = content
            elif kind == "status" and content["execution_state"] == "idle":
                return cell

    def shutdown(self) -> None:
        self.client.stop_channels()
        if self.manager.is_alive():
            self.manager.shutdown_kernel(now=True)


def with_session() -> Iterator[RunningKernel]:
    """A module fixture's body: a kernel with the magics loaded and 2 CPU ranks started."""
    running = RunningKernel()
    setup = running.run("%load_ext notebook_launcher\n%distributed start -n 2 --hardware cpu")
    assert setup.error is None, setup.error
    yield running
    if running.manager.is_alive():  # a test may have killed the kernel on purpose
        running.run("%distributed stop")
    running.shutdown()


def run_ok(kernel: RunningKernel, code: str) -> CellRun:
    """Run a cell that must not raise."""
    cell = kernel.run(code)
    assert cell.error is None, cell.error
    return cell


class CellEnded(AssertionError):
    """The cell ended before the output a test waited for; ``cell`` holds what it showed."""

    def __init__(self, text: str, cell: CellRun) -> None:
        super().__init__(f"the cell ended before {text!r} appeared: {cell.error}\n{cell}")
        self.cell = cell


def wait_for_output(
    kernel: RunningKernel, msg_id: str, texts: list[str], timeout: float = 900
) -> CellRun:
    """The running cell's output until each of ``texts`` appeared in its stdout; raises
    CellEnded at once if the cell ends first (``timeout`` is a safety net)."""
    seen = CellRun()
    for text in texts:
        if text in seen.stdout:
            continue
        part = kernel.collect(msg_id, timeout, until=text)
        seen.stdout += part.stdout
        seen.stderr += part.stderr
        seen.error = part.error
        if text not in seen.stdout:  # collect() returned because the cell ended
            raise CellEnded(text, seen)
    return seen
