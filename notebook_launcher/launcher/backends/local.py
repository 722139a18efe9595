"""Ranks as processes of this machine, started with fork, forkserver or spawn."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator, Sequence
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
        self.pid = process.pid
        with contextlib.suppress(OSError):  # races the rank's own setpgid; either wins
            os.setpgid(process.pid, process.pid)

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
        controls: list[RankControl] = []
        try:
            with _main_module_hidden(plan.start.method != "fork"):
                for spec, rank_ends in zip(specs, ends):
                    process = context.Process(  # type: ignore[attr-defined]
                        target=target,
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
