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
from notebook_launcher.launcher import backends, elastic, rendezvous, report, store
from notebook_launcher.launcher.events import (
    GroupRestarting,
    LaunchEvent,
    LaunchFinished,
    LaunchObserver,
    LaunchStarted,
    RankWhere,
)
from notebook_launcher.launcher.plan import LaunchPlan
from notebook_launcher.launcher.rank import RankSpec
from notebook_launcher.launcher.rank_group import Outcome, RankGroup
from notebook_launcher.launcher.rendezvous import Rendezvous, Round, open_rendezvous


class Emitter:
    """Sends each event to every observer, in the calling thread."""

    def __init__(self, observers: list[LaunchObserver]) -> None:
        self._observers = observers
        self.where: dict[int, str] = {}  # where the ranks were when an interrupt ended them

    def __call__(self, event: LaunchEvent) -> None:
        if isinstance(event, RankWhere):
            self.where[event.rank] = event.where
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
    """Run ``function`` on every rank of ``plan`` on this machine; return their values,
    in rank order (on several machines: this machine's ranks').

    Each attempt (the first, and each restart of ``max_restarts``) is one rendezvous
    round with a fresh store and a fresh rank group.
    """
    backend = backends.lookup(plan.backend)
    backends.check_supports(backend, plan.accelerator)
    backend.check(plan)
    payload = backend.prepare_payload(plan, (function, args, kwargs))  # refuses what cannot travel
    emit = Emitter(observers)
    try:
        return _execute(plan, backend, payload, emit, _fingerprint(plan, function))
    except KeyboardInterrupt:
        # Every rank has been ended by now; the traceback ends here, not in the selector
        # the interrupt happened to land in.
        where = report.where_block(emit.where).rstrip("\n")
        raise KeyboardInterrupt(
            "the launch was stopped; every rank has been ended" + (f".{where}" if where else "")
        ) from None


def _execute(
    plan: LaunchPlan, backend: Any, payload: Any, emit: Emitter, fingerprint: dict[str, Any]
) -> list[Any]:
    launch_id = uuid.uuid4().hex[:12]
    started = time.monotonic()
    deadline = started + plan.timeout if plan.timeout is not None else None
    with contextlib.ExitStack() as cleanup:
        meeting = open_rendezvous(
            rendezvous.config_of(plan),
            plan.master_addr,
            plan.port,
            plan.num_processes,
            fingerprint=fingerprint,
            deadline=deadline,
            timeout_s=plan.timeout,
            emit=emit,
        )
        cleanup.callback(meeting.close)
        emit(
            LaunchStarted(
                plan.num_processes,
                plan.start.method,
                plan.accelerator,
                plan.mixed_precision,
                plan.start.fallback_reason,
                first_rank=_first_rank(plan),
            )
        )
        cleanup.push(_FinishedOnError(emit, started))
        attempt = 0
        first_failure = None
        while True:
            try:
                outcome = _run_attempt(
                    plan, backend, payload, meeting, attempt, launch_id, emit, deadline
                )
            except rendezvous.RendezvousError as error:
                if first_failure is None:
                    raise
                # The restart could not meet (a peer is gone): keep what started it all.
                raise type(error)(
                    f"{error}\nThis machine was restarting ({attempt} of max_restarts="
                    f"{plan.max_restarts}) after: rank {first_failure.rank} failed with "
                    f"{elastic.describe(first_failure)}."
                ) from error
            if not elastic.should_restart(outcome, attempt, plan.max_restarts):
                break
            attempt += 1
            failure = elastic.root_failure(outcome)
            first_failure = first_failure or failure
            emit(
                GroupRestarting(
                    attempt,
                    plan.max_restarts,
                    failure,
                    elastic.restart_line(attempt, plan.max_restarts, failure),
                )
            )
        if not (outcome.failures or outcome.timed_out_ranks or outcome.stopped_from_outside):
            meeting.finish()
    return report.finish(outcome, plan, emit, time.monotonic() - started)


def _run_attempt(
    plan: LaunchPlan,
    backend: Any,
    payload: Any,
    meeting: Rendezvous,
    attempt: int,
    launch_id: str,
    emit: Emitter,
    deadline: float | None,
) -> Outcome:
    """One round: start this machine's ranks, run them until an outcome, close them."""
    with contextlib.ExitStack() as cleanup:
        round_ = meeting.next_round(attempt)
        cleanup.callback(round_.close)
        group = RankGroup(
            plan,
            backend,
            rank_specs(plan, launch_id, round_=round_, attempt=attempt),
            emit,
            launch_id=launch_id,
        )
        cleanup.callback(group.close)
        group.start(payload)
        round_.serve()
        record = _register(launch_id, plan, [r.pid for r in group.ranks if r.pid is not None])
        cleanup.callback(record.close)
        return group.run(deadline=deadline, stop_requested=record.stop_requested)
    raise AssertionError("unreachable")  # for type checkers: the with block returns


def _first_rank(plan: LaunchPlan) -> int | None:
    """This machine's first global rank, where it is known before the rendezvous."""
    if plan.num_nodes > 1 and plan.rdzv_backend == "c10d":
        return None  # the c10d rendezvous assigns the group ranks
    return plan.node_rank * plan.num_processes


def _fingerprint(plan: LaunchPlan, function: Callable[..., Any]) -> dict[str, Any]:
    """What every machine of a launch must agree on, besides the counts."""
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return {
        "mixed_precision": plan.mixed_precision,
        "function": f"{getattr(function, '__module__', None) or '?'}.{name}",
    }


class _FinishedOnError:
    """An exit callback: the launch ended by an exception (interrupt, an observer's bug)."""

    def __init__(self, emit: Emitter, started: float) -> None:
        self._emit, self._started = emit, started

    def __call__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if kind is not None:
            outcome = "interrupted" if issubclass(kind, KeyboardInterrupt) else "error"
            self._emit.safely(LaunchFinished(outcome, time.monotonic() - self._started))
        return False


def rank_specs(
    plan: LaunchPlan,
    launch_id: str,
    port: int | None = None,
    *,
    round_: Round | None = None,
    attempt: int = 0,
) -> list[RankSpec]:
    """What each local rank of ``plan`` needs besides the function (its environment...).

    ``round_`` says where this attempt's ranks meet and this machine's group rank; without
    it (one machine), they meet at ``plan.master_addr:port``.
    """
    if round_ is None:
        round_ = Round(plan.node_rank, plan.num_nodes, plan.master_addr, port or 0, None)
    fork = plan.start.method == "fork"
    torch = sys.modules.get("torch")
    # A fork already carries the kernel's RNG state; fresh interpreters are handed it.
    # As bytes: a tensor sent through multiprocessing would be moved to shared memory.
    torch_rng = (
        bytes(torch.random.get_rng_state().numpy()) if torch is not None and not fork else None
    )
    python_rng = random.getstate()
    environ = dict(os.environ)
    nproc = plan.num_processes
    # What torchrun's agent also tells its workers, so elastic-aware code can read it.
    elastic_vars = {
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(plan.max_restarts),
        "TORCHELASTIC_RUN_ID": plan.rdzv_id if round_.num_nodes > 1 else launch_id,
        "GROUP_WORLD_SIZE": str(round_.num_nodes),
    }
    specs = []
    for local_rank in range(nproc):
        rank = round_.group_rank * nproc + local_rank
        rank_environ = rank_env.rank_environment(
            launch_id=launch_id,
            rank=rank,
            local_rank=local_rank,
            world_size=round_.num_nodes * nproc,
            local_world_size=nproc,
            group_rank=round_.group_rank,
            master_addr=round_.master_addr,
            master_port=round_.master_port,
            mixed_precision=plan.mixed_precision,
            accelerator=plan.accelerator,
            threads_per_rank=plan.threads_per_rank,
            environ=environ,
        )
        rank_environ.update(elastic_vars)
        rank_environ.update(plan.rank_environ)
        if round_.secret is not None:
            rank_environ[store.SECRET_ENV] = round_.secret
        specs.append(
            RankSpec(
                rank=rank,
                local_rank=local_rank,
                environ=rank_environ,
                cwd=os.getcwd(),
                sys_path=list(sys.path),
                accelerator=plan.accelerator,
                threads=plan.threads_per_rank if "OMP_NUM_THREADS" not in environ else None,
                python_random_state=python_rng,
                torch_rng_state=torch_rng,
                keep_result_devices=plan.keep_result_devices,
            )
        )
    return specs


def _register(launch_id: str, plan: LaunchPlan, rank_pids: list[int]) -> registry.RegisteredLaunch:
    return registry.RegisteredLaunch(
        registry.LaunchRecord(
            launch_id=launch_id,
            kernel_id=registry.current_kernel_id(),
            kernel_pid=os.getpid(),
            num_processes=plan.num_processes,
            accelerator=plan.accelerator,
            mixed_precision=plan.mixed_precision,
            start_method=plan.start.method,
            state="running",
            started_at=time.time(),
            rank_pids=rank_pids,
        )
    )
