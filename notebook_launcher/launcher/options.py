"""Checking each argument of a launch before anything starts.

Each check is a small pure function whose message says what was given, why it cannot
work and what to do instead; :mod:`notebook_launcher.launcher.plan` composes them.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import types
from collections.abc import Mapping, Sequence
from typing import Any

from notebook_launcher import rules
from notebook_launcher.errors import LaunchConfigError, LaunchTypeError
from notebook_launcher.hardware import HardwareReport

RDZV_BACKENDS = ("static", "c10d")
# Options of rdzv_conf that launcher/rendezvous.py reads; torchrun's names, and the shared secret.
RDZV_CONF_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "timeout",
    "is_host",
    "local_addr",
    "secret",
)


def check_not_inside_rank(inside_rank: bool) -> None:
    if inside_rank:
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


def check_scale_out(
    num_nodes: Any,
    node_rank: Any,
    rdzv_backend: Any,
    rdzv_endpoint: Any,
    rdzv_conf: Any,
    rdzv_id: Any,
    max_restarts: Any,
) -> dict[str, Any]:
    """The multi-node and elastic arguments, checked (LaunchPlan's fields of those names)."""
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
        raise LaunchTypeError(
            f"rdzv_id must be a non-empty string naming the job; got {rdzv_id!r}."
        )
    conf = dict(rdzv_conf or {})
    unknown = sorted(set(conf) - set(RDZV_CONF_KEYS))
    if unknown:
        raise LaunchConfigError(
            f"rdzv_conf has {', '.join(repr(k) for k in unknown)}, which this launcher does not "
            f"use (it would be ignored); the keys it reads are {', '.join(RDZV_CONF_KEYS)}."
        )
    for key in ("join_timeout", "last_call_timeout", "close_timeout", "timeout"):
        if key in conf:
            check_seconds(
                f"rdzv_conf[{key!r}]", _number(conf[key]), example="900", allow_none=False
            )
    return {
        "num_nodes": num_nodes,
        "node_rank": node_rank,
        "rdzv_backend": rdzv_backend,
        "rdzv_endpoint": rdzv_endpoint.strip(),
        "rdzv_id": rdzv_id,
        "rdzv_conf": types.MappingProxyType(conf),
        "max_restarts": _whole_number("max_restarts", max_restarts, minimum=0),
    }


def _whole_number(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise LaunchTypeError(
            f"{name} must be a whole number; got {type(value).__name__} {value!r}."
        )
    if value < minimum:
        raise LaunchConfigError(f"{name} must be at least {minimum}; got {value}.")
    return int(value)


def _number(value: Any) -> Any:
    with contextlib.suppress(TypeError, ValueError):
        return float(value)
    return value


def unknown_choice(argument: str, value: Any, choices: Sequence[Any], note: str = "") -> str:
    """The message for a value that is none of ``choices``; ``note`` ends it, after them."""
    return f"{argument}={value!r} is not known; use one of {', '.join(map(repr, choices))}{note}."


def check_choice(argument: str, value: Any, choices: Sequence[Any], note: str = "") -> str:
    """``value`` as the rules spell it ("BF16 " is "bf16"), if it is one of ``choices``."""
    name = rules.canonical(value)
    if not isinstance(name, str) or name not in choices:
        raise LaunchConfigError(unknown_choice(argument, value, choices, note))
    return name


def resolve_accelerator(hardware: Any, report: HardwareReport) -> str:
    name = check_choice("hardware", hardware, rules.HARDWARE_CHOICES)
    accelerator = report.accelerator if name == "auto" else name
    if accelerator == "cuda" and not report.gpus:
        raise LaunchConfigError(
            "hardware='cuda' but no NVIDIA GPU was found (nvidia-smi lists none). "
            "Use hardware='cpu' or 'auto'."
        )
    if accelerator == "tpu" and not report.tpu_cores and report.tpu is None:
        raise LaunchConfigError(
            "hardware='tpu' but no TPU was found (no TPU device files or TPU environment). "
            "Use hardware='cpu' or 'auto'."
        )
    return accelerator


def check_num_processes(value: Any, accelerator: str, report: HardwareReport) -> int:
    if value is None:
        return rules.default_num_processes(report, accelerator)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise LaunchTypeError(
            f"num_processes must be a whole number of ranks; got {type(value).__name__} "
            f"{value!r}. Pass e.g. num_processes=2."
        )
    value = int(value)
    problem = rules.num_processes_problem(value, report, accelerator)
    if problem is not None:
        raise LaunchConfigError(f"{problem}.")
    return value


def check_mixed_precision(value: Any, accelerator: str, report: HardwareReport) -> str:
    if value is None:
        return "no"
    precision = check_choice("mixed_precision", value, rules.PRECISIONS)
    reason = rules.precision_support(report, accelerator)[precision]
    if reason is not None:
        raise LaunchConfigError(f"mixed_precision={precision!r} cannot run here: {reason}.")
    return precision


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


def check_seconds(name: str, value: Any, *, example: str, allow_none: bool) -> float | None:
    """A positive, finite number of seconds (None too, where it means "no limit")."""
    if value is None and allow_none:
        return None
    unset = ", or leave it None for no limit" if allow_none else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise LaunchTypeError(
            f"{name} must be a number of seconds; got {type(value).__name__} {value!r}. "
            f"Pass e.g. {name}={example}{unset}."
        )
    seconds = float(value)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise LaunchConfigError(
            f"{name} must be a positive number of seconds; got {value!r}. "
            f"Pass e.g. {name}={example}{unset}."
        )
    return seconds


def check_output(output: Any) -> str:
    name = rules.canonical(output)
    if name not in rules.OUTPUT_MODES:
        raise LaunchConfigError(
            f"output={output!r} is not an output mode; use 'all' (every rank, prefixed), "
            "'main' (rank 0 only) or 'none'."
        )
    return str(name)


def check_prefix_template(template: Any) -> str | None:
    if template is not None and not isinstance(template, str):
        raise LaunchTypeError(
            f"log_line_prefix_template must be a string such as '[${{rank}}]: '; got {template!r}."
        )
    return template


def check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, numbers.Integral)) or value not in (0, 1):
        raise LaunchTypeError(
            f"{name} must be True or False; got {type(value).__name__} {value!r}."
        )
    return bool(value)


def threads_per_rank(num_processes: int, report: HardwareReport) -> int:
    """Divide the cores among ranks; oversubscribed ranks ran 2.7x slower here."""
    return max(1, report.cpu_count // num_processes)
