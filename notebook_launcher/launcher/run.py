"""Running one planned launch: start the ranks, watch them, clean up, report."""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
import time
import uuid
from multiprocessing.context import BaseContext
from typing import Any, Callable

from notebook_launcher import rank_env, registry
from notebook_launcher.errors import (
    LaunchStoppedError,
    LaunchTimeoutError,
    RankFailedError,
    rank_failed_error_class,
)
from notebook_launcher.launcher import elastic
from notebook_launcher.launcher.events import (
    GroupRestarting,
    LaunchEvent,
    LaunchFinished,
    LaunchObserver,
    LaunchStarted,
    RankStarted,
)
from notebook_launcher.launcher.monitor import Monitor, Outcome
from notebook_launcher.launcher.options import LaunchPlan
from notebook_launcher.launcher.pickling import dump_payload
from notebook_launcher.launcher.processes import RankProcess, close_all
from notebook_launcher.launcher.rank import RankSpec
from notebook_launcher.launcher.rendezvous import Round, open_rendezvous

# Modules the forkserver imports once, so each later rank starts in milliseconds.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "cloudpickle", "notebook_launcher.launcher.rank"]
_STOP_GRACE_S = 3.0


def start_context(method: str) -> BaseContext:
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        # Takes effect when the forkserver first starts; it then stays warm for the kernel.
        context.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return context


def execute(
    plan: LaunchPlan,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    observers: list[LaunchObserver],
) -> list[Any]:
    """Run ``function`` on every rank of ``plan`` on this machine; return their values.

    The values are this machine's ranks', in local rank order (on one machine: by rank).
    """
    fork = plan.start.method == "fork"
    # By value for fresh interpreters; a fork shares the kernel's memory as it is.
    payload: Any = (function, args, kwargs) if fork else dump_payload(function, args, kwargs)

    def emit(event: LaunchEvent) -> None:
        for observer in observers:
            observer.on_event(event)

    started = time.monotonic()
    deadline = started + plan.timeout if plan.timeout is not None else None
    launch_id = uuid.uuid4().hex[:12]
    rendezvous = open_rendezvous(plan.rendezvous, plan.master_addr, plan.port, plan.num_processes)
    try:
        emit(LaunchStarted(plan.num_processes, plan.start.method, plan.accelerator,
                           plan.mixed_precision, plan.start.fallback_reason))
        attempt = 0
        while True:
            round_ = rendezvous.next_round(attempt)
            try:
                outcome, ranks_here = _run_group(
                    plan, payload, fork, round_, attempt, launch_id, emit, deadline
                )
            finally:
                round_.close()
            if not elastic.should_restart(outcome, attempt, plan.max_restarts):
                break
            attempt += 1
            failure = elastic.root_failure(outcome)
            emit(GroupRestarting(attempt, plan.max_restarts, failure,
                                 elastic.restart_line(attempt, plan.max_restarts, failure)))
        if not (outcome.failures or outcome.timed_out_ranks or outcome.stopped_from_outside):
            rendezvous.finish()
    except KeyboardInterrupt:
        emit(LaunchFinished("interrupted", time.monotonic() - started))
        raise
    finally:
        rendezvous.close()
    return _finish(outcome, ranks_here, plan, emit, time.monotonic() - started)


def _run_group(
    plan: LaunchPlan,
    payload: Any,
    fork: bool,
    round_: Round,
    attempt: int,
    launch_id: str,
    emit: Callable[[LaunchEvent], None],
    deadline: float | None,
) -> tuple[Outcome, list[int]]:
    """Start this machine's ranks for one round, watch them until they end, stop them."""
    ranks: list[RankProcess] = []
    record = None
    specs = _rank_specs(plan, launch_id, round_, attempt, fork)
    try:
        context = start_context(plan.start.method)
        for spec in specs:
            ranks.append(RankProcess(context, spec, payload))
            emit(RankStarted(spec.rank, ranks[-1].pid, _device(plan, spec.local_rank)))
        record = _register(launch_id, plan, [r.pid for r in ranks])
        outcome = Monitor(
            ranks, emit, poll_interval=plan.monitor_interval, deadline=deadline,
            stop_requested=record.stop_requested, grace_s=_STOP_GRACE_S,
        ).run()
    finally:
        close_all(ranks, _STOP_GRACE_S)
        if record is not None:
            record.close()
    return outcome, [spec.rank for spec in specs]


def _finish(
    outcome: Outcome,
    ranks_here: list[int],
    plan: LaunchPlan,
    emit: Callable[[LaunchEvent], None],
    elapsed: float,
) -> list[Any]:
    if outcome.failures:
        emit(LaunchFinished("failed", elapsed))
        raise _rank_failed_error(outcome)
    if outcome.timed_out_ranks:
        emit(LaunchFinished("timeout", elapsed))
        ranks = ", ".join(str(r) for r in outcome.timed_out_ranks)
        raise LaunchTimeoutError(
            f"the launch ran past timeout={plan.timeout:g}s; rank(s) {ranks} were still running "
            "and have been stopped. Raise timeout= if the work needs longer, or look at where "
            "those ranks wait (a collective that other ranks never reach hangs)."
        )
    if outcome.stopped_from_outside:
        emit(LaunchFinished("stopped", elapsed))
        raise LaunchStoppedError("the launch was stopped from the JupyterLab sidebar; every rank was stopped.")
    emit(LaunchFinished("ok", elapsed))
    return [outcome.results[rank].value() for rank in ranks_here]


def _rank_failed_error(outcome: Outcome) -> RankFailedError:
    failures = sorted(outcome.failures, key=lambda f: f.time)
    root = failures[0]
    lines = [f"{root.summary()}; the other ranks were stopped."]
    for later in failures[1:]:
        lines.append(f"Afterwards, {later.summary()[0].lower()}{later.summary()[1:]}.")
    if root.traceback:
        lines += ["", f"Traceback from rank {root.rank}:", root.traceback.rstrip()]
    elif root.output_tail:
        lines += ["", f"Last output of rank {root.rank}:", root.output_tail]
    remote = outcome.remote_exceptions.get(root.rank)
    error = rank_failed_error_class(type(remote) if remote is not None else None)(
        "\n".join(lines), failures
    )
    if remote is not None:
        error.__cause__ = remote
    return error


def _rank_specs(
    plan: LaunchPlan, launch_id: str, round_: Round, attempt: int, fork: bool
) -> list[RankSpec]:
    torch = sys.modules.get("torch")
    # A fork already carries the kernel's RNG state; fresh interpreters are handed it.
    # As bytes: a tensor sent through multiprocessing would be moved to shared memory.
    torch_rng = bytes(torch.random.get_rng_state().numpy()) if torch is not None and not fork else None
    python_rng = random.getstate()
    environ = dict(os.environ)
    nproc = plan.num_processes
    # What torchrun's agent also tells its workers, so elastic-aware code can read it.
    elastic_vars = {
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(plan.max_restarts),
        "TORCHELASTIC_RUN_ID": plan.rendezvous.run_id if plan.rendezvous else launch_id,
        "GROUP_WORLD_SIZE": str(round_.num_nodes),
    }
    specs = []
    for local_rank in range(nproc):
        rank = round_.group_rank * nproc + local_rank
        rank_environ = rank_env.rank_environment(
            launch_id=launch_id, rank=rank, local_rank=local_rank,
            world_size=round_.num_nodes * nproc, local_world_size=nproc,
            group_rank=round_.group_rank, master_addr=round_.master_addr,
            master_port=round_.master_port, mixed_precision=plan.mixed_precision,
            accelerator=plan.accelerator, threads_per_rank=plan.threads_per_rank,
            environ=environ,
        )
        rank_environ.update(elastic_vars)
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
            )
        )
    return specs


def _device(plan: LaunchPlan, local_rank: int) -> str:
    return f"cuda:{local_rank}" if plan.accelerator == "cuda" else plan.accelerator


def _register(launch_id: str, plan: LaunchPlan, rank_pids: list[int]) -> registry.RegisteredLaunch:
    return registry.RegisteredLaunch(
        registry.LaunchRecord(
            launch_id=launch_id, kernel_id=registry.current_kernel_id(), kernel_pid=os.getpid(),
            num_processes=plan.num_processes, accelerator=plan.accelerator,
            mixed_precision=plan.mixed_precision, start_method=plan.start.method,
            state="running", started_at=time.time(), rank_pids=rank_pids,
        )
    )

