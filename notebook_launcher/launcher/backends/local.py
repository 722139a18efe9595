"""Ranks as processes of this machine, started with fork, forkserver or spawn."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any

from notebook_launcher.launcher.backends.base import (
    Backend,
    Ended,
    RankControl,
    RankEnds,
    RankTarget,
    Started,
)
from notebook_launcher.launcher.pickling import dump_payload

if TYPE_CHECKING:
    from notebook_launcher.launcher.plan_types import LaunchPlan
    from notebook_launcher.launcher.rank import RankSpec

# Modules the forkserver imports once, so each later rank starts in milliseconds.
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "cloudpickle",
    "notebook_launcher.launcher.rank",
]
_ABANDON_WAIT_S = 2.0  # a rank started before a later one failed to start: time to end


def start_context(method: str) -> BaseContext:
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        # Takes effect when the forkserver first starts; it then stays warm for the kernel.
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
    return context


class ProcessControl(RankControl):
    """A rank that is a multiprocessing process of the kernel, leading its own process group."""

    def __init__(self, process: Any) -> None:
        self._process = process
        # The rank's group is left to the rank: it starts a session of its own, which a
        # process made a group leader from here could not. Until it has, signal() falls
        # back to the rank alone, which has started nothing yet.
        self.pid = process.pid

    @property
    def sentinel(self) -> int | None:
        return int(self._process.sentinel)

    def poll(self) -> Ended | None:
        code = self._process.exitcode
        return None if code is None else Ended(code)

    def signal(self, signum: int) -> None:
        """Signal the rank's whole process group (the rank alone if it has none yet)."""
        assert self.pid is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)
            return
        if self._process.exitcode is None:  # not reaped: the pid is still this rank's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signum)

    def wait(self, timeout: float) -> Ended | None:
        self._process.join(max(0.0, timeout))
        return self.poll()

    def release(self) -> None:
        if self._process.exitcode is not None:
            self._process.close()


class LocalBackend(Backend):
    name = "local"
    accelerators = ("cpu", "cuda")
    description = "processes of this machine"
    chosen_by_auto_for = ("cpu", "cuda")
    supports_sessions = True

    def prepare_payload(self, plan: LaunchPlan, payload: tuple[Any, ...]) -> Any:
        if plan.start.method == "fork":
            return payload  # a fork shares the kernel's memory as it is
        function, args, kwargs = payload
        return dump_payload(function, args, kwargs)

    def start(
        self,
        plan: LaunchPlan,
        specs: Sequence[RankSpec],
        ends: Sequence[RankEnds],
        payload: Any,
        target: RankTarget,
    ) -> Started:
        context = start_context(plan.start.method)
        forking = plan.start.method == "fork"
        controls: list[RankControl] = []
        try:
            with _main_module_hidden(not forking), _fork_warning_silenced(forking) as rank_target:
                for spec, rank_ends in zip(specs, ends):
                    process = context.Process(  # type: ignore[attr-defined]
                        target=rank_target(target),
                        args=(spec, payload, rank_ends),
                        name=f"notebook_launcher-rank{spec.rank}",
                    )
                    process.start()
                    controls.append(ProcessControl(process))
        except BaseException:
            for control in controls:
                control.signal(signal.SIGKILL)
                control.wait(_ABANDON_WAIT_S)
                control.release()
            raise
        return Started(controls)


# What Python 3.12 and later warn at every fork of a process that has threads (a Jupyter
# kernel always has some: its heartbeat, IOPub and control threads, the history writer).
_FORK_WITH_THREADS = (
    r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks"
)


@contextlib.contextmanager
def _fork_warning_silenced(forking: bool) -> Iterator[Callable[[RankTarget], RankTarget]]:
    """Python's warning about forking a process with threads, left out for our own forks.

    The deadlock it warns of is a child that takes a lock some other thread of the parent
    held at the fork, and that thread does not exist in the child to release it. A forked
    rank touches nothing those threads own: before it runs the user's function it closes the
    descriptors it inherited (the kernel's ZMQ sockets among them), replaces sys.stdout and
    sys.stderr by streams of its own (ipykernel's talk to its IOPub thread), and starts its
    own threads; the locks it does take are reinitialised in the child by Python (the import
    lock, threading, logging's handlers), glibc (malloc) and torch (its intra-op thread
    pool), as for torch's DataLoader workers, which fork from threaded processes every
    epoch. Where a fork would really break the ranks (CUDA initialised in the kernel, a
    process group there), the start-method rules never fork. So the warning is silenced for
    our fork call alone: by its message, for the time of the call (``catch_warnings`` changes
    the filters of the whole process meanwhile: a warning of the same text from another
    thread of this kernel in those milliseconds is silenced too), and undone in each rank
    before the user's function runs, so that forks the user's code makes still warn.
    """
    if not forking:
        yield lambda target: target
        return
    silenced = warnings.catch_warnings()
    with silenced:
        warnings.filterwarnings("ignore", message=_FORK_WITH_THREADS, category=DeprecationWarning)

        def rank_target(target: RankTarget) -> RankTarget:
            def forked_rank(*args: Any) -> None:
                silenced.__exit__(None, None, None)  # the filters as they were before the fork
                target(*args)

            return forked_rank

        yield rank_target


@contextlib.contextmanager
def _main_module_hidden(hide: bool) -> Iterator[None]:
    """Keep fresh interpreters from re-running the calling script as their ``__main__``.

    multiprocessing re-imports the parent's main script in every spawned child, which
    re-runs an unguarded script's launch in each rank. Ranks receive the function and its
    arguments by value, so they never need that module.
    """
    main = sys.modules["__main__"]
    saved: dict[str, Any] = {
        name: main.__dict__[name] for name in ("__spec__", "__file__") if name in main.__dict__
    }
    if not hide or (not saved.get("__file__") and saved.get("__spec__") is None):
        yield
        return
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)


BACKEND = LocalBackend()
