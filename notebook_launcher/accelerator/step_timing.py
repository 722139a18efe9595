"""Where a rank's training step goes: computing, waiting in collectives, waiting for data.

A step is the time from one optimizer step (one that applies gradients) to the next. Inside
it three things are measured:

- the time DDP's gradient all-reduce keeps the backward pass waiting: a comm hook notes when
  the last gradient bucket was handed to the all-reduce (the backward's computing is over)
  and when the last all-reduce finished (the backward returns then); the gap is the wait
  that overlapping with the backward did not hide;
- the explicit collectives of the step (``gather``, ``reduce``, ...), timed around the call;
- the time the prepared data loader took to hand over the next batch.

What is left is computing. Each rank sends the medians of its last steps through
:mod:`notebook_launcher.tracking` about once a second and once at the end; the launch turns
them into one sentence (``notebook_launcher.launcher.diagnosis``). The cost is a few clock
readings a step and one Python callback per gradient bucket, as torch's own Python
``allreduce_hook`` costs: measured beside DDP's built-in all-reduce at about 0.2 ms a step
on a busy 2-core machine (``benchmarks/bench_step_timing.py``). DDP's reducer also times
itself, but only on sampled iterations and with a wait that differed from this one's.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

from notebook_launcher import tracking

KEPT_STEPS = 512  # medians over the last steps: a warm-up or an evaluation pass fades out
REPORT_EVERY_S = 1.0

_active: StepClock | None = None  # the clock of this process's latest Accelerator


class StepClock:
    """One rank's step anatomy, built up as the training loop runs."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        # Gradients reduced by a way this clock cannot time (FSDP2, a comm hook of the user's
        # registered before ours could be): the collectives of a step are then unknown.
        self.collectives_unknown = False
        self._lock = threading.Lock()  # the comm hook's callbacks run on the backend's thread
        self._last_end: float | None = None
        self._collectives = 0.0
        self._data = 0.0
        self._bucket_handed: float | None = None  # when the last bucket went to the all-reduce
        self._bucket_done: float | None = None  # when the last all-reduce finished
        self._steps: collections.deque[tuple[float, float, float]] = collections.deque(
            maxlen=KEPT_STEPS
        )
        self.count = 0
        self._last_report = 0.0
        self._reported_count = -1

    # ---- what the training loop does ------------------------------------------------
    def step_ended(self) -> None:
        """An optimizer step applied gradients: one step is complete."""
        now = time.perf_counter()
        with self._lock:
            waited = 0.0
            if self._bucket_handed is not None and self._bucket_done is not None:
                waited = max(0.0, self._bucket_done - self._bucket_handed)
            collectives, data = self._collectives + waited, self._data
            self._collectives = self._data = 0.0
            self._bucket_handed = self._bucket_done = None
            if self._last_end is not None:  # the first step's start is not known
                wall = now - self._last_end
                self._steps.append((wall, min(collectives, wall), min(data, wall)))
                self.count += 1
            self._last_end = now
        if now - self._last_report >= REPORT_EVERY_S:
            self.report()

    def paused(self) -> None:
        """The loop stopped stepping for a while (a new Accelerator, an evaluation): the next
        step starts from its own optimizer step, not from the last one."""
        with self._lock:
            self._last_end = None

    def add_collective(self, seconds: float) -> None:
        with self._lock:
            self._collectives += seconds

    def add_data_wait(self, seconds: float) -> None:
        with self._lock:
            self._data += seconds

    def bucket_handed(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self._bucket_handed = now

    def bucket_done(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self._bucket_done = now

    # ---- what it tells ----------------------------------------------------------------
    def summary(self) -> dict[str, Any] | None:
        """``{"count", "median_s", "compute_s", "collectives_s", "data_s"}`` (medians per
        step, in seconds), or None before two optimizer steps were taken."""
        with self._lock:
            steps = list(self._steps)
            count = self.count
        if not steps:
            return None
        return {
            "count": count,
            "median_s": statistics.median(s[0] for s in steps),
            "compute_s": statistics.median(max(0.0, s[0] - s[1] - s[2]) for s in steps),
            "collectives_s": None
            if self.collectives_unknown
            else statistics.median(s[1] for s in steps),
            "data_s": statistics.median(s[2] for s in steps),
        }

    def report(self) -> None:
        """Send the summary to whoever listens (the launch), when there are new steps."""
        self._last_report = time.perf_counter()
        if self.count == self._reported_count:
            return
        summary = self.summary()
        if summary is not None:
            self._reported_count = self.count
            tracking.emit_steps(self.rank, summary)


def start(rank: int, world_size: int) -> StepClock:
    """The clock of a new Accelerator; it becomes the one data loaders and collectives feed."""
    global _active
    if _active is not None:
        _active.report()
    clock = _active = StepClock(rank, world_size)
    tracking.add_steps_final(_report_active)
    return clock


def _report_active() -> None:
    if _active is not None:
        _active.report()


def add_data_wait(seconds: float) -> None:
    """Time a prepared data loader spent producing a batch."""
    if _active is not None:
        _active.add_data_wait(seconds)


@contextlib.contextmanager
def collective() -> Iterator[None]:
    """Times an explicit collective (gather, reduce) into the current step."""
    if _active is None:
        yield
        return
    start_at = time.perf_counter()
    try:
        yield
    finally:
        _active.add_collective(time.perf_counter() - start_at)


# ---- DDP's gradient all-reduce -------------------------------------------------------------


def time_ddp(ddp: Any, clock: StepClock) -> None:
    """Time the gradient all-reduce of ``ddp`` through a comm hook, registered at its first
    forward: a hook the user registers on the prepared model before that is timed instead
    of replaced (DDP takes one hook only)."""
    timed_by_us = False

    def first_forward(module: Any, args: Any) -> None:
        handle.remove()
        with contextlib.suppress(AttributeError):
            del module.register_comm_hook  # the instance's own: a pickled model carries none
        if timed_by_us:
            return
        if getattr(module, "_comm_hooks", None):  # registered before prepare(), untimed
            clock.collectives_unknown = True
            return
        module.register_comm_hook(module.process_group, timed_allreduce(clock))

    original = ddp.register_comm_hook

    def register_comm_hook(state: object, hook: Callable[..., Any]) -> None:
        nonlocal timed_by_us
        original(state, timed_hook(hook, clock))
        timed_by_us = True

    handle = ddp.register_forward_pre_hook(first_forward)
    ddp.register_comm_hook = register_comm_hook


def timed_allreduce(clock: StepClock) -> Callable[..., Any]:
    """DDP's default all-reduce (the mean of the ranks' gradients), with the moment each
    bucket is handed over and each reduction ends noted: one Python callback per bucket,
    as torch's own ``allreduce_hook`` has (wrapping that one would add a second)."""
    import torch.distributed as dist

    def allreduce(process_group, bucket):  # unannotated: see timed_hook
        group = process_group if process_group is not None else dist.group.WORLD
        clock.bucket_handed()
        tensor = bucket.buffer()
        tensor.div_(dist.get_world_size(group))
        future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def reduced(done):
            clock.bucket_done()
            return done.value()[0]

        return future.then(reduced)

    allreduce.__qualname__ = "allreduce_hook"
    return allreduce


def timed_hook(hook: Callable[..., Any], clock: StepClock | None = None) -> Callable[..., Any]:
    """``hook`` with the moment each bucket is handed over and each reduction ends noted."""

    # Unannotated: DDP refuses a hook whose annotations are not GradBucket and Future, and
    # under ``from __future__ import annotations`` they are strings.
    def timed(state, bucket):
        owner = clock or _active
        if owner is None:
            return hook(state, bucket)
        owner.bucket_handed()
        future = hook(state, bucket)

        def reduced(done: Any) -> Any:
            owner.bucket_done()
            return done.value()

        return future.then(reduced)

    timed.__qualname__ = getattr(hook, "__qualname__", "timed_hook")
    return timed
