"""Resolving one call into a frozen plan: a pure function of what it is given.

``resolve_plan(call, defaults, report, kernel)`` reads the call's arguments, the
effective defaults (configure() in this kernel over the saved file, each field with its
source), the hardware report and the kernel's state, and nothing else: no detection, no
file, no environment. A value that is refused and came from the defaults says which
layer it came from; a value given in the call never blames the defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterator, Mapping
from typing import Any

from notebook_launcher.defaults import EffectiveDefaults
from notebook_launcher.errors import LaunchConfigError, LaunchTypeError
from notebook_launcher.hardware import HardwareReport
from notebook_launcher.launcher import options
from notebook_launcher.launcher.start_method import (
    KernelState,
    StartMethodChoice,
    choose_start_method,
)

_NO_CONF: Mapping[str, Any] = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class LaunchCall:
    """The arguments of one ``notebook_launcher()`` call, as given (nothing checked yet)."""

    num_processes: Any = None
    mixed_precision: Any = None
    use_port: Any = None
    master_addr: Any = "127.0.0.1"
    node_rank: Any = 0
    num_nodes: Any = 1
    rdzv_backend: Any = "static"
    rdzv_endpoint: Any = ""
    rdzv_conf: Any = None
    rdzv_id: Any = "none"
    max_restarts: Any = 0
    monitor_interval: Any = 0.1
    log_line_prefix_template: Any = None
    hardware: Any = "auto"
    start_method: Any = None
    timeout: Any = None
    return_all: Any = False
    output: Any = "all"
    backend: Any = "auto"
    keep_result_devices: Any = False
    ray_address: Any = None


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything a backend and the rank group need; built only by :func:`resolve_plan`."""

    backend: str  # the backend module: "local", "xla", "ray"
    num_processes: int  # ranks on this machine (per node in a multi-node launch)
    accelerator: str  # "cpu", "cuda", "tpu" or "mps"
    mixed_precision: str
    start: StartMethodChoice
    master_addr: str
    port: int | None  # None: the OS picks a free one
    threads_per_rank: int | None
    timeout: float | None
    monitor_interval: float
    output: str
    prefix_template: str | None
    return_all: bool
    keep_result_devices: bool = False  # False: tensors in results come back on the CPU
    num_nodes: int = 1
    node_rank: int = 0
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _NO_CONF)
    max_restarts: int = 0
    ray_address: str | None = None  # backend="ray": the cluster to join (None: RAY_ADDRESS or a local one)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.num_processes + local_rank

    def device(self, local_rank: int) -> str:
        return f"cuda:{local_rank}" if self.accelerator == "cuda" else self.accelerator


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
        call.num_nodes, call.node_rank, call.rdzv_backend, call.rdzv_endpoint, call.rdzv_conf,
        call.rdzv_id, call.max_restarts,
    )
    chosen = defaults.values
    accelerator = options.resolve_accelerator(call.hardware, report)
    backend = options.resolve_backend(call.backend, accelerator)
    with _blamed(defaults, "num_processes", call.num_processes):
        num = options.check_num_processes(
            chosen.num_processes if call.num_processes is None else call.num_processes,
            accelerator, report,
        )
    with _blamed(defaults, "mixed_precision", call.mixed_precision):
        precision = options.check_mixed_precision(
            chosen.mixed_precision if call.mixed_precision is None else call.mixed_precision,
            accelerator, report,
        )
    with _blamed(defaults, "start_method", call.start_method):
        requested = chosen.start_method if call.start_method is None else call.start_method
        start = choose_start_method("auto" if requested is None else requested, kernel)
    monitor_interval = options.check_seconds(
        "monitor_interval", call.monitor_interval, example="0.1", allow_none=False
    ) or 0.1  # never None here: allow_none=False
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
        ray_address=options.check_ray_address(call.ray_address, backend),
        **scale_out,
    )


def _check_address(address: Any) -> str:
    if not isinstance(address, str) or not address.strip():
        raise LaunchTypeError(
            f"master_addr must be a host name or IP address such as '127.0.0.1'; got {address!r}."
        )
    return address.strip()
