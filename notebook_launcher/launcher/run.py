"""Running one planned launch: plan -> rank group -> report.

Every resource of the launch (the store's port, the ranks and their pipes, the sidebar's
record) is released through one ExitStack, so an interrupt at any moment, even a second
one while the ranks are being stopped, leaves nothing behind, and ``LaunchFinished`` is
sent on every path that sent ``LaunchStarted``.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
import uuid
from types import TracebackType
from typing import Any, Callable

from notebook_launcher import rank_env, registry
from notebook_launcher.launcher import backends, report
from notebook_launcher.launcher.events import (
    LaunchEvent,
    LaunchFinished,
    LaunchObserver,
    LaunchStarted,
)
from notebook_launcher.launcher.plan import LaunchPlan
from notebook_launcher.launcher.rank import RankSpec
from notebook_launcher.launcher.rank_group import RankGroup
from notebook_launcher.launcher.store import RendezvousStore, bind_listener


class Emitter:
    """Sends each event to every observer, in the calling thread."""

    def __init__(self, observers: list[LaunchObserver]) -> None:
        self._observers = observers

    def __call__(self, event: LaunchEvent) -> None:
        for observer in self._observers:
            observer.on_event(event)

    def safely(self, event: LaunchEvent) -> None:
        """Deliver to every observer even if one raises (the launch is ending anyway)."""
        for observer in self._observers:
            with contextlib.suppress(Exception):
                observer.on_event(event)


def execute(
    plan: LaunchPlan,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    observers: list[LaunchObserver],
) -> list[Any]:
    """Run ``function`` on every rank of ``plan``; return the values, indexed by rank."""
    backend = backends.lookup(plan.backend)
    backends.check_supports(backend, plan.accelerator)
    backend.check(plan)
    payload = backend.prepare_payload(plan, (function, args, kwargs))  # refuses what cannot travel
    emit = Emitter(observers)
    launch_id = uuid.uuid4().hex[:12]
    started = time.monotonic()
    with contextlib.ExitStack() as cleanup:
        listener = bind_listener(plan.master_addr, plan.port)
        cleanup.callback(listener.close)
        store = RendezvousStore(listener, plan.world_size)
        cleanup.callback(store.close)
        emit(LaunchStarted(plan.num_processes, plan.start.method, plan.accelerator,
                           plan.mixed_precision, plan.start.fallback_reason))
        cleanup.push(_FinishedOnError(emit, started))
        group = RankGroup(
            plan, backend, rank_specs(plan, launch_id, store.port), emit, launch_id=launch_id
        )
        cleanup.callback(group.close)
        group.start(payload)
        record = _register(launch_id, plan, [r.pid for r in group.ranks if r.pid is not None])
        cleanup.callback(record.close)
        deadline = started + plan.timeout if plan.timeout is not None else None
        outcome = group.run(deadline=deadline, stop_requested=record.stop_requested)
    return report.finish(outcome, plan, emit, time.monotonic() - started)


class _FinishedOnError:
    """An exit callback: the launch ended by an exception (interrupt, an observer's bug)."""

    def __init__(self, emit: Emitter, started: float) -> None:
        self._emit, self._started = emit, started

    def __call__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if kind is not None:
            outcome = "interrupted" if issubclass(kind, KeyboardInterrupt) else "error"
            self._emit.safely(LaunchFinished(outcome, time.monotonic() - self._started))
        return False


def rank_specs(plan: LaunchPlan, launch_id: str, port: int) -> list[RankSpec]:
    """What each local rank of ``plan`` needs besides the function (its environment...)."""
    fork = plan.start.method == "fork"
    torch = sys.modules.get("torch")
    # A fork already carries the kernel's RNG state; fresh interpreters are handed it.
    # As bytes: a tensor sent through multiprocessing would be moved to shared memory.
    torch_rng = bytes(torch.random.get_rng_state().numpy()) if torch is not None and not fork else None
    python_rng = random.getstate()
    environ = dict(os.environ)
    specs = []
    for local_rank in range(plan.num_processes):
        rank = plan.global_rank(local_rank)
        specs.append(RankSpec(
            rank=rank,
            local_rank=local_rank,
            environ=rank_env.rank_environment(
                launch_id=launch_id, rank=rank, local_rank=local_rank, world_size=plan.world_size,
                local_world_size=plan.num_processes, group_rank=plan.node_rank,
                master_addr=plan.master_addr, master_port=port,
                mixed_precision=plan.mixed_precision, accelerator=plan.accelerator,
                threads_per_rank=plan.threads_per_rank, environ=environ,
            ),
            cwd=os.getcwd(),
            sys_path=list(sys.path),
            accelerator=plan.accelerator,
            threads=plan.threads_per_rank if "OMP_NUM_THREADS" not in environ else None,
            python_random_state=python_rng,
            torch_rng_state=torch_rng,
            keep_result_devices=plan.keep_result_devices,
        ))
    return specs


def _register(launch_id: str, plan: LaunchPlan, rank_pids: list[int]) -> registry.RegisteredLaunch:
    return registry.RegisteredLaunch(
        registry.LaunchRecord(
            launch_id=launch_id, kernel_id=registry.current_kernel_id(), kernel_pid=os.getpid(),
            num_processes=plan.num_processes, accelerator=plan.accelerator,
            mixed_precision=plan.mixed_precision, start_method=plan.start.method,
            state="running", started_at=time.time(), rank_pids=rank_pids,
        )
    )
