"""Where every process a test started stands, for a test that ran past its safety net.

pytest-timeout shows only the test process's own threads; a hang usually sits in a kernel or a
rank below it. py-spy (a test dependency) reads each descendant's Python stack without
stopping it for long; where py-spy is missing or refused, the kernel's view of each thread
(its state and the kernel function it waits in) is shown instead.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import psutil

_PER_PROCESS_S = 20  # a safety net for one py-spy dump of a process that is itself stuck


def descendants_stacks(pid: int | None = None) -> str:
    """Each live descendant of ``pid`` (this process by default): its command line and stacks."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return "(the process is gone)"
    parts = [_stacks_of(child) for child in children]
    return "\n\n".join(p for p in parts if p) or "(no child processes)"


def _stacks_of(process: psutil.Process) -> str:
    try:
        header = (
            f"== pid {process.pid} (parent {process.ppid()}): {' '.join(process.cmdline())[:200]!r}"
        )
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""
    # The venv's own, where the tests run without the venv on PATH.
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy:
        try:
            done = subprocess.run(
                [py_spy, "dump", "--pid", str(process.pid)],
                capture_output=True,
                text=True,
                timeout=_PER_PROCESS_S,
            )
            if done.returncode == 0:
                return f"{header}\n{done.stdout.rstrip()}"
            header += f"\n(py-spy: {done.stderr.strip()[-300:]})"
        except subprocess.TimeoutExpired:
            header += f"\n(py-spy did not answer within {_PER_PROCESS_S}s)"
    return f"{header}\n{_threads_from_proc(process.pid)}"


def _threads_from_proc(pid: int) -> str:
    """Each thread's name, state and the kernel function it sleeps in."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*"), key=lambda p: int(p.name)):
        try:
            name = (task / "comm").read_text().strip()
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (task / "wchan").read_text().strip() or "-"
        except OSError:
            continue
        lines.append(f"  thread {task.name} {name!r}: state {state}, waiting in {wchan}")
    return "\n".join(lines) or "  (its threads could not be read)"
