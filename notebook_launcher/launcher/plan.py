"""Resolving one call into a frozen plan: a pure function of what it is given.

``resolve_plan(call, defaults, report, kernel)`` reads the call's arguments, the
effective defaults (configure() in this kernel over the saved file, each field with its
source), the hardware report and the kernel's state, and nothing else: no detection, no
file, no environment. A value that is refused and came from the defaults says which
layer it came from; a value given in the call never blames the defaults.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from notebook_launcher.defaults import EffectiveDefaults
from notebook_launcher.errors import LaunchConfigError, LaunchTypeError
from notebook_launcher.hardware import HardwareReport
from notebook_launcher.launcher import backends, options
from notebook_launcher.launcher.plan_types import LaunchCall, LaunchPlan
from notebook_launcher.launcher.start_method import KernelState, choose_start_method

__all__ = ["LaunchCall", "LaunchPlan", "resolve_plan"]


@contextlib.contextmanager
def _blamed(defaults: EffectiveDefaults, field: str, given: Any) -> Iterator[None]:
    """Add where a refused value came from, when it came from the defaults, not the call."""
    try:
        yield
    except LaunchConfigError as error:
        blame = defaults.blame(field) if given is None else None
        if blame is None:
            raise
        raise type(error)(f"{error} {blame}") from error


def resolve_plan(
    call: LaunchCall, defaults: EffectiveDefaults, report: HardwareReport, kernel: KernelState
) -> LaunchPlan:
    """The plan for ``call`` on this machine and kernel; LaunchConfigError (or a kind of
    it) when anything rules the launch out, before any process starts."""
    options.check_not_inside_rank(kernel.inside_rank)
    scale_out = options.check_scale_out(
        call.num_nodes,
        call.node_rank,
        call.rdzv_backend,
        call.rdzv_endpoint,
        call.rdzv_conf,
        call.rdzv_id,
        call.max_restarts,
    )
    chosen = defaults.values
    accelerator = options.resolve_accelerator(call.hardware, report)
    backend = backends.resolve(call.backend, accelerator)
    backend_options = backends.check_options(backend, call.backend_options)
    with _blamed(defaults, "num_processes", call.num_processes):
        num = options.check_num_processes(
            chosen.num_processes if call.num_processes is None else call.num_processes,
            accelerator,
            report,
        )
    with _blamed(defaults, "mixed_precision", call.mixed_precision):
        precision = options.check_mixed_precision(
            chosen.mixed_precision if call.mixed_precision is None else call.mixed_precision,
            accelerator,
            report,
        )
    with _blamed(defaults, "start_method", call.start_method):
        requested = chosen.start_method if call.start_method is None else call.start_method
        start = choose_start_method("auto" if requested is None else requested, kernel)
    monitor_interval = (
        options.check_seconds(
            "monitor_interval", call.monitor_interval, example="0.1", allow_none=False
        )
        or 0.1
    )  # never None here: allow_none=False
    return LaunchPlan(
        backend=backend,
        num_processes=num,
        accelerator=accelerator,
        mixed_precision=precision,
        start=start,
        master_addr=_check_address(call.master_addr),
        port=options.check_port(call.use_port),
        threads_per_rank=options.threads_per_rank(num, report),
        timeout=options.check_seconds("timeout", call.timeout, example="600", allow_none=True),
        monitor_interval=monitor_interval,
        output=options.check_output(call.output),
        prefix_template=options.check_prefix_template(call.log_line_prefix_template),
        return_all=options.check_flag("return_all", call.return_all),
        keep_result_devices=options.check_flag("keep_result_devices", call.keep_result_devices),
        backend_options=backend_options,
        **scale_out,
    )


def _check_address(address: Any) -> str:
    if not isinstance(address, str) or not address.strip():
        raise LaunchTypeError(
            f"master_addr must be a host name or IP address such as '127.0.0.1'; got {address!r}."
        )
    return address.strip()
