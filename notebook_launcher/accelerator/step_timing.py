"""Where a rank's training step goes: computing, waiting in collectives, waiting for data.

A step is the time from one optimizer step (one that applies gradients) to the next. Inside
it three things are measured:

- the time the backward pass waits for DDP's gradient all-reduce: from the moment autograd
  has computed every gradient (every bucket has been handed to the all-reduce) to the
  moment the backward returns (the all-reduces finished, the gradients written back). DDP
  keeps its own all-reduce, the built-in one in C++ or a comm hook of the user's; two
  autograd final callbacks note the two moments (see :func:`time_ddp`). The division of
  the gradients by the number of ranks, which DDP does as each gradient is ready, counts
  as computing;
- the explicit collectives of the step (``gather``, ``reduce``, ...), timed around the call;
- the time the prepared data loader took to hand over the next batch.

What is left is computing. Each rank sends the medians of its last steps through
:mod:`notebook_launcher.tracking` about once a second and once at the end; the launch turns
them into one sentence (``notebook_launcher.launcher.diagnosis``).

What it costs, a step: a forward hook on the DDP model with a pre-hook on its output's
node, two final callbacks, four clock readings; no lock and no Python per gradient bucket.
Measured directly in one process (``benchmarks/bench_step_timing.py``): about 9 us a step,
0.4 % of a 2 ms DDP step of width 256 at a batch of 8 and 0.04 % of a 25 ms one. Side by
side on 2 CPU ranks of a shared 2-core machine (load 1.6-8), the same model with and without
the timing: the medians of the rounds' ratios 0.98-1.06 and 0.99-1.04, within that
machine's noise. A Python comm hook, as used before, cost the small step 1.12-1.15x alone: a
Python call and a callback on the backend's thread per bucket, and the mean's division in a
pass of its own. The report sent about once a second (medians over 512 steps: 0.4 ms) is not in
these figures.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import time
from collections.abc import Iterator, Mapping
from typing import Any

from torch.autograd import Variable

from notebook_launcher import tracking

KEPT_STEPS = 512  # medians over the last steps: a warm-up or an evaluation pass fades out
REPORT_EVERY_S = 1.0

_active: StepClock | None = None  # the clock of this process's latest Accelerator
_ENGINE = Variable._execution_engine  # queue_callback: run at the end of the current backward


class StepClock:
    """One rank's step anatomy, built up as the training loop runs."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        # Gradients reduced by a way this clock cannot time (FSDP2): the collectives of a
        # step are then unknown.
        self.collectives_unknown = False
        # No lock: everything below is fed by the training thread, or by autograd's device
        # thread while the training thread waits in backward().
        self._last_end: float | None = None
        self._collectives = 0.0
        self._data = 0.0
        self._tail_queued = False  # the current backward's final callbacks are queued
        self._computed_at = 0.0  # when the current backward's computing was over
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
        collectives, data = self._collectives, self._data
        self._collectives = self._data = 0.0
        last, self._last_end = self._last_end, now
        if last is not None:  # the first step's start is not known
            wall = now - last
            self._steps.append((wall, min(collectives, wall), min(data, wall)))
            self.count += 1
        if now - self._last_report >= REPORT_EVERY_S:
            self.report()

    def paused(self) -> None:
        """The loop stopped stepping for a while (a new Accelerator, an evaluation): the next
        step starts from its own optimizer step, not from the last one."""
        self._last_end = None

    def add_collective(self, seconds: float) -> None:
        self._collectives += seconds

    def add_data_wait(self, seconds: float) -> None:
        self._data += seconds

    # ---- what it tells ----------------------------------------------------------------
    def summary(self) -> dict[str, Any] | None:
        """``{"count", "median_s", "compute_s", "collectives_s", "data_s"}`` (medians per
        step, in seconds), or None before two optimizer steps were taken."""
        steps = list(self._steps)  # one C call: atomic under the GIL
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


def time_ddp(ddp: Any, clock: StepClock) -> Any:
    """Time how long the backward passes of ``ddp`` wait for its gradient all-reduce.

    DDP's all-reduce (its built-in one in C++, or a comm hook of the user's) is left as it
    is: a Python comm hook costs a Python call and a callback on the backend's thread per
    bucket, 12-15 % of a small CPU step as measured. Instead, after each forward that builds
    a graph, a pre-hook on the output's node queues an autograd final callback when the
    backward starts. Final callbacks run in order once the graph is done: ours was queued
    before DDP's (which DDP queues when its last bucket is ready, and which waits for the
    all-reduces and writes the gradients back), so it runs when the computing is over; it
    queues a second one, which runs after DDP's, when the backward is about to return."""
    return ddp.register_forward_hook(_BackwardTail(clock))  # its handle takes it off


class _BackwardTail:
    """The forward hook and the two final callbacks of :func:`time_ddp` (a class rather than
    closures: a prepared model stays picklable). What a backward is doing lives on the
    clock, so that one backward through two prepared models is timed once."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def __call__(self, module: Any, args: Any, output: Any) -> None:
        self.clock._tail_queued = False  # a backward that raised ran no final callbacks
        # Every top-level tensor of the output: the loss may come from any of them.
        if isinstance(output, Mapping):
            candidates: Any = output.values()
        elif isinstance(output, (tuple, list)):
            candidates = output
        else:
            candidates = (output,)
        for tensor in candidates:
            node = getattr(tensor, "grad_fn", None)
            if node is not None:
                node.register_prehook(self._backward_started)

    def _backward_started(self, grad_outputs: Any) -> None:
        if not self.clock._tail_queued:
            self.clock._tail_queued = True
            _ENGINE.queue_callback(self._computed)

    def _computed(self) -> None:
        self.clock._computed_at = time.perf_counter()
        _ENGINE.queue_callback(self._reduced)

    def _reduced(self) -> None:
        clock = self.clock
        clock._collectives += time.perf_counter() - clock._computed_at
        clock._tail_queued = False
