"""Checking a launch's arguments before anything starts, and resolving them into a plan.

Each check is a small function whose message says what was given, why it cannot work
and what to do instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from collections.abc import Iterator, Mapping
from typing import Any

from notebook_launcher import rank_env
from notebook_launcher.errors import LaunchConfigError, LaunchTypeError
from notebook_launcher.hardware import PRECISIONS, HardwareReport, precision_support
from notebook_launcher.launcher.printer import OUTPUT_MODES
from notebook_launcher.launcher.rendezvous import RDZV_BACKENDS, RendezvousConfig
from notebook_launcher.launcher.start_method import (
    KernelState,
    StartMethodChoice,
    choose_start_method,
)

HARDWARE_CHOICES = ("auto", "cpu", "cuda", "tpu", "mps")


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    num_processes: int
    accelerator: str  # "cpu" or "cuda"
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
    rendezvous: RendezvousConfig | None = None  # None: this machine alone
    max_restarts: int = 0


@contextlib.contextmanager
def blame_saved_defaults(*used: bool) -> Iterator[None]:
    """Say so when a refused value came from the saved defaults, not from the call."""
    try:
        yield
    except LaunchConfigError as error:
        if not any(used):
            raise
        from notebook_launcher.defaults import defaults_path

        raise type(error)(
            f"{error} The value came from your saved launch defaults ({defaults_path()}): pass "
            "the argument explicitly, or change the defaults in the JupyterLab sidebar."
        ) from error


def check_not_inside_rank() -> None:
    if rank_env.inside_rank():
        raise LaunchConfigError(
            "notebook_launcher() was called inside a rank of a running launch; launches "
            "cannot be nested. Call it from the notebook, and run the per-rank code directly "
            "in the launched function."
        )


def check_function(function: Any) -> None:
    if not callable(function):
        raise LaunchTypeError(
            f"function must be callable (the training function to run on every rank); got "
            f"{type(function).__name__} {function!r}. Pass the function itself, not its result: "
            "notebook_launcher(train, args=(...)), not notebook_launcher(train(...))."
        )


def check_args(args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not isinstance(args, (tuple, list)):
        raise LaunchTypeError(
            f"args must be a tuple or list of positional arguments; got {type(args).__name__} "
            f"{args!r}. For one argument write args=({args!r},) with the trailing comma."
        )
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise LaunchTypeError(
            f"kwargs must be a dict of keyword arguments with string keys; got {kwargs!r}."
        )
    return tuple(args), dict(kwargs)


def check_rendezvous(
    node_rank: Any, num_nodes: Any, rdzv_backend: Any, rdzv_endpoint: Any, rdzv_conf: Any,
    rdzv_id: Any,
) -> RendezvousConfig | None:
    """The multi-node arguments, checked; None when the launch stays on this machine."""
    num_nodes = _whole_number("num_nodes", num_nodes, minimum=1)
    node_rank = _whole_number("node_rank", node_rank, minimum=0)
    if node_rank >= num_nodes:
        raise LaunchConfigError(
            f"node_rank={node_rank} but num_nodes={num_nodes}: node ranks run from 0 to "
            f"{num_nodes - 1}. Give each machine its own node_rank below num_nodes."
        )
    if rdzv_backend not in RDZV_BACKENDS:
        raise LaunchConfigError(
            f"rdzv_backend={rdzv_backend!r} is not known; use 'static' (node_rank decides each "
            "machine's ranks) or 'c10d' (torch's dynamic rendezvous)."
        )
    if not isinstance(rdzv_endpoint, str):
        raise LaunchTypeError(f"rdzv_endpoint must be a 'host:port' string; got {rdzv_endpoint!r}.")
    if rdzv_conf is not None and (
        not isinstance(rdzv_conf, Mapping) or not all(isinstance(k, str) for k in rdzv_conf)
    ):
        raise LaunchTypeError(
            f"rdzv_conf must be a dict such as {{'join_timeout': 900}}; got {rdzv_conf!r}."
        )
    if not isinstance(rdzv_id, str) or not rdzv_id:
        raise LaunchTypeError(f"rdzv_id must be a non-empty string naming the job; got {rdzv_id!r}.")
    conf = dict(rdzv_conf or {})
    for key in ("join_timeout", "last_call_timeout", "close_timeout", "timeout"):
        if key in conf:
            check_seconds(f"rdzv_conf[{key!r}]", _number(conf[key]), allow_none=False)
    if num_nodes == 1 and not rdzv_endpoint:
        return None  # one machine: the kernel hosts the store; the backends would agree
    return RendezvousConfig(
        backend=rdzv_backend, num_nodes=num_nodes, node_rank=node_rank,
        endpoint=rdzv_endpoint.strip(), run_id=rdzv_id, conf=conf,
    )


def check_max_restarts(value: Any) -> int:
    return _whole_number("max_restarts", value, minimum=0)


def _whole_number(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise LaunchTypeError(f"{name} must be a whole number; got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise LaunchConfigError(f"{name} must be at least {minimum}; got {value}.")
    return int(value)


def _number(value: Any) -> Any:
    with contextlib.suppress(TypeError, ValueError):
        return float(value)
    return value


def resolve_accelerator(hardware: Any, report: HardwareReport) -> str:
    if hardware not in HARDWARE_CHOICES:
        raise LaunchConfigError(
            f"hardware={hardware!r} is not known; use one of "
            + ", ".join(repr(h) for h in HARDWARE_CHOICES)
            + "."
        )
    accelerator = report.accelerator if hardware == "auto" else hardware
    if accelerator == "cuda" and not report.gpus:
        raise LaunchConfigError(
            "hardware='cuda' but no NVIDIA GPU was found (nvidia-smi lists none). "
            "Use hardware='cpu' or 'auto'."
        )
    if accelerator in ("tpu", "mps"):
        raise NotImplementedError(
            f"launching on {accelerator.upper()} is not implemented yet (the {accelerator.upper()} "
            "issue area). Pass hardware='cpu' to run CPU ranks meanwhile."
        )
    return accelerator


def check_num_processes(value: Any, accelerator: str, report: HardwareReport) -> int:
    if value is None:
        return len(report.gpus) if accelerator == "cuda" else min(2, report.cpu_count) or 1
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise LaunchTypeError(
            f"num_processes must be a whole number of ranks; got {type(value).__name__} "
            f"{value!r}. Pass e.g. num_processes=2."
        )
    value = int(value)
    if value < 1:
        raise LaunchConfigError(f"num_processes must be at least 1; got {value}.")
    if accelerator == "cuda" and value > len(report.gpus):
        names = ", ".join(g.name for g in report.gpus)
        raise LaunchConfigError(
            f"num_processes={value} but this machine has {len(report.gpus)} GPU(s) ({names}); "
            f"each rank needs its own GPU. Use num_processes<={len(report.gpus)}, or "
            "hardware='cpu' for CPU ranks."
        )
    return value


def check_mixed_precision(value: Any, accelerator: str, report: HardwareReport) -> str:
    if value is None:
        return "no"
    if not isinstance(value, str) or value.lower() not in PRECISIONS:
        raise LaunchConfigError(
            f"mixed_precision={value!r} is not known; use one of "
            + ", ".join(repr(p) for p in PRECISIONS)
            + "."
        )
    value = value.lower()
    reason = precision_support(report, accelerator)[value]
    if reason is not None:
        raise LaunchConfigError(f"mixed_precision={value!r} cannot run here: {reason}.")
    return value


def check_port(use_port: Any) -> int | None:
    """accelerate passes the port as a string ("29500"); any int-like value works here."""
    if use_port is None:
        return None
    text = str(use_port).strip()
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise LaunchConfigError(
            f"use_port={use_port!r} is not a TCP port; give a number from 1 to 65535, or leave "
            "it unset to get a free port."
        )
    return int(text)


def check_seconds(name: str, value: Any, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        raise LaunchConfigError(f"{name} must be a positive number of seconds; got {value!r}.")
    return float(value)


def check_output(output: Any) -> str:
    if output not in OUTPUT_MODES:
        raise LaunchConfigError(
            f"output={output!r} is not an output mode; use 'all' (every rank, prefixed), "
            "'main' (rank 0 only) or 'none'."
        )
    return str(output)


def check_prefix_template(template: Any) -> str | None:
    if template is not None and not isinstance(template, str):
        raise LaunchTypeError(
            f"log_line_prefix_template must be a string such as '[${{rank}}]: '; got {template!r}."
        )
    return template


def choose_start(requested: Any, kernel: KernelState) -> StartMethodChoice:
    return choose_start_method(str(requested) if requested is not None else "auto", kernel)


def threads_per_rank(num_processes: int, report: HardwareReport) -> int:
    """Divide the cores among ranks; oversubscribed ranks ran 2.7x slower here."""
    return max(1, report.cpu_count // num_processes)
