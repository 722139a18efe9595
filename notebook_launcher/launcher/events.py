"""What a launch tells its observers (the text printer now, a live dashboard later).

The launcher knows nothing of how events are shown: it calls ``on_event`` of each
observer from the thread that called ``notebook_launcher()``, which in a notebook is the
cell's own thread, so whatever an observer prints lands in the calling cell.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Union

from notebook_launcher.errors import RankFailure
from notebook_launcher.launcher.metric_batch import MetricBatch


@dataclasses.dataclass(frozen=True)
class LaunchStarted:
    num_processes: int
    start_method: str
    accelerator: str
    mixed_precision: str
    fallback_reason: str | None  # why "auto" did not fork
    # This machine's ranks are first_rank .. first_rank + num_processes - 1; None where only
    # the rendezvous decides (c10d), so that they are known by their RankStarted alone.
    first_rank: int | None = 0


@dataclasses.dataclass(frozen=True)
class RankStarted:
    rank: int  # global rank
    pid: int | None  # None where the backend learns it only when the rank reports it
    device: str


@dataclasses.dataclass(frozen=True)
class OutputLine:
    rank: int
    stream: str  # "stdout" or "stderr"
    text: str
    is_progress: bool  # a state of a line redrawn with "\r" (a progress bar)


@dataclasses.dataclass(frozen=True)
class RankProgress:
    rank: int
    n: int
    total: int | None
    description: str


@dataclasses.dataclass(frozen=True)
class RankMetrics:
    """``Accelerator.log`` calls of a rank, in order, their numbers as floats. Calls made
    in quick succession come as one event, so a rank that logs in a tight loop costs
    observers a few calls a second; ``batch.calls()`` gives one dict per call, and
    ``batch.columns`` each metric's values as one array."""

    rank: int
    batch: MetricBatch


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """A rank's peak memory so far: RSS on a CPU rank, torch's ``max_memory_allocated``
    on a CUDA rank. Sent when it grew, at most about once a second, and once at the end."""

    rank: int
    kind: str  # "rss" or "cuda"
    peak_bytes: int
    current_bytes: int
    device: str
    rss_bytes: int | None = None  # the process's resident memory now, also on a GPU rank


@dataclasses.dataclass(frozen=True)
class RankSteps:
    """Where a rank's training steps go, from the Accelerator: ``summary`` holds ``count``
    and, as medians per step in seconds, ``median_s``, ``compute_s``, ``collectives_s``
    (None where the gradient reduction could not be timed) and ``data_s``. Sent about once
    a second while steps are taken, and once at the end."""

    rank: int
    summary: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class RankFinished:
    rank: int
    exitcode: int | None
    failure: RankFailure | None  # None: returned normally, or was stopped by the launcher
    state: str = "done"  # "done" (returned), "failed" or "stopped" (by the launcher)


@dataclasses.dataclass(frozen=True)
class RankWhere:
    """Where a rank still running was when the launch ended it from outside (its
    ``timeout=``, the stop button, a stop from the sidebar), sent just before it is ended:
    ``where`` reads ``was in cell 5, line 3 (in train), in all_reduce (waiting for the
    others)``, or ``did not say where it was``."""

    rank: int
    where: str


@dataclasses.dataclass(frozen=True)
class GroupRestarting:
    """The ranks of this machine failed and start again (``max_restarts``)."""

    restart: int  # 1 for the first restart
    max_restarts: int
    failure: RankFailure  # the root cause of the attempt that failed
    line: str  # what the cell shows: "restart 1 of 3: rank 1 failed with ..."


@dataclasses.dataclass(frozen=True)
class RendezvousWaiting:
    """This machine waits for the others of a multi-node launch (sent every few seconds)."""

    waiting_for: str  # "the rendezvous store" or "machines"
    joined: tuple[int, ...]  # node ranks that joined (empty while the store is awaited)
    missing: tuple[int, ...]  # node ranks not there yet (static), empty where unknown (c10d)
    waited_s: float
    limit_s: float  # join_timeout, or what is left of timeout= if that is shorter
    line: str  # what the cell shows


@dataclasses.dataclass(frozen=True)
class LaunchFinished:
    # "ok", "failed", "timeout", "interrupted", "stopped", or "error" (the launcher or an
    # observer raised); sent on every path that sent LaunchStarted
    outcome: str
    elapsed: float


LaunchEvent = Union[
    LaunchStarted,
    RankStarted,
    OutputLine,
    RankProgress,
    RankMetrics,
    RankMemory,
    RankSteps,
    RankFinished,
    RankWhere,
    GroupRestarting,
    RendezvousWaiting,
    LaunchFinished,
]


class LaunchObserver(Protocol):
    def on_event(self, event: LaunchEvent) -> None: ...
