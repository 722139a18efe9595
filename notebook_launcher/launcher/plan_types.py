"""What one ``notebook_launcher()`` call asks for, and the frozen plan it resolves to.

The plan is read by the backends, the rank group and the report; how a call becomes a
plan is :mod:`notebook_launcher.launcher.plan`'s.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from notebook_launcher.launcher.start_method import StartMethodChoice

_NOTHING: Mapping[str, Any] = types.MappingProxyType({})


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
    # Keywords that no argument of notebook_launcher() takes: the backends' own (ray_address).
    backend_options: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _NOTHING)


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything a backend and the rank group need; built only by :func:`resolve_plan`."""

    backend: str  # the registered backend that starts the ranks: "local", "xla", "ray", ...
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
    rdzv_conf: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _NOTHING)
    max_restarts: int = 0
    # Every option the backend declares, checked by it (None: not given), such as ray_address.
    backend_options: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _NOTHING)
    # Set in every rank on top of the contract: what the GPU checks found NCCL needs.
    rank_environ: Mapping[str, str] = dataclasses.field(default_factory=lambda: _NOTHING)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.num_processes + local_rank

    def device(self, local_rank: int) -> str:
        return f"cuda:{local_rank}" if self.accelerator == "cuda" else self.accelerator
