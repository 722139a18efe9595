"""One launch, without any display: check the call, plan it, run it for the observers given.

The launcher knows no UI: what a launch shows comes from its observers. The public
``notebook_launcher()`` (:mod:`notebook_launcher.api`) adds the dashboard between the two
steps, so that a call with a wrong argument fails before any dashboard is built.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any, Callable

from notebook_launcher import gpu_guards
from notebook_launcher.defaults import effective_defaults
from notebook_launcher.hardware import HardwareReport
from notebook_launcher.hardware import detect as detect_hardware
from notebook_launcher.launcher import options
from notebook_launcher.launcher.events import LaunchObserver
from notebook_launcher.launcher.plan import LaunchCall, LaunchPlan, resolve_plan
from notebook_launcher.launcher.printer import TextPrinter
from notebook_launcher.launcher.run import execute
from notebook_launcher.launcher.start_method import KernelState


@dataclasses.dataclass(frozen=True)
class PreparedLaunch:
    """A checked call and its plan, ready to run."""

    plan: LaunchPlan
    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def run(self, observers: Sequence[LaunchObserver] = (), *, progress_lines: bool = True) -> Any:
        """Rank 0's return value, or every rank's in a list with ``return_all``.

        The ranks' lines go to the text printer, then every event to ``observers``;
        ``progress_lines=False`` (an observer shows progress) prints only bars' final states.
        """
        printer = TextPrinter(
            self.plan.output, self.plan.prefix_template, progress_lines=progress_lines
        )
        values = execute(self.plan, self.function, self.args, self.kwargs, [printer, *observers])
        return values if self.plan.return_all else values[0]


def prepare(
    function: Callable[..., Any], args: Any, kwargs: Any, call: LaunchCall
) -> PreparedLaunch:
    """Check the call and plan it; LaunchConfigError (or LaunchTypeError) if it cannot run."""
    kernel = KernelState.detect()
    options.check_not_inside_rank(kernel.inside_rank)
    options.check_function(function)
    call_args, call_kwargs = options.check_args(args, kwargs)
    # Read at call time: a default saved in the sidebar or chosen in configure() applies at once.
    report = detect_hardware()
    plan = resolve_plan(call, effective_defaults(), report, kernel)
    if plan.accelerator == "cuda":
        plan = _guard_gpus(plan, report)
    return PreparedLaunch(plan, function, call_args, call_kwargs)


def _guard_gpus(plan: LaunchPlan, report: HardwareReport) -> LaunchPlan:
    """Refuse GPUs the installed torch cannot run on; set what NCCL needs on this machine."""
    gpus = report.gpus[: plan.num_processes]
    gpu_guards.check_architectures(gpus, gpu_guards.torch_arch_list(), report.torch_version)
    if plan.num_processes < 2:
        return plan
    settings = gpu_guards.nccl_settings(
        plan.num_processes,
        os.environ,
        gpu_guards.probe_peer_access(os.environ.get("CUDA_VISIBLE_DEVICES")),
        gpu_guards.shm_size(),
    )
    for line in settings.lines:
        print(line, file=sys.stderr, flush=True)
    return dataclasses.replace(plan, rank_environ={**plan.rank_environ, **settings.environ})
