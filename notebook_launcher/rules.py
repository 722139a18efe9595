"""The one source of every launch rule: what each option may be, and where it can run.

The launcher, the defaults file, the server extension (and through it the sidebar), the
notebook panel and the command line all take their vocabulary and their limits from
here, so they never disagree. Every rule is a pure function of facts passed in (the
hardware report, the platform), so tests can fake any machine. This module imports
neither torch nor the launcher.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from notebook_launcher.machine import GpuInfo, Machine

PRECISIONS = ("no", "fp16", "bf16", "fp8")
START_METHODS = ("auto", "fork", "forkserver", "spawn")
OUTPUT_MODES = ("all", "main", "none")
HARDWARE_CHOICES = ("auto", "cpu", "cuda", "tpu", "mps")


def canonical(value: object) -> object:
    """A choice as the rules name it: "BF16 " and "bf16" are the same precision everywhere."""
    return value.strip().lower() if isinstance(value, str) else value


DEVICE_WORDS = {"cuda": "GPU", "tpu": "TPU", "mps": "MPS", "cpu": "CPU"}

# CPU ranks share the cores, so no device count bounds them. Each one is a whole Python
# process with its own copy of torch (150-300 MB), and past a few per core they only wait
# for one another; a count in the thousands would exhaust memory or descriptors long
# before the first rank ran. So: 4 per core, never fewer than 16 (enough to try code
# written for a 16-GPU world on a laptop), and never more than the open-files limit
# allows, since the kernel holds a few descriptors per rank while the launch runs.
CPU_RANKS_PER_CORE = 4
MIN_CPU_RANK_LIMIT = 16
KERNEL_FDS_PER_RANK = 6  # stdout, stderr, message channel, exit sentinel, store socket, commands
_FDS_KEPT_FREE = 64  # for the kernel's own files, sockets and the notebook's


def precision_support(report: Machine, accelerator: str | None = None) -> dict[str, str | None]:
    """Map each precision to None when ``accelerator`` can run it, else to the reason it can't.

    Only what torch cannot run is refused: fp16 autocast and gradient scaling run on CPU
    (slowly, but correctly), so fp16 is allowed there, as accelerate allows it.
    """
    accelerator = accelerator or report.accelerator
    support: dict[str, str | None] = dict.fromkeys(PRECISIONS)
    if accelerator == "cuda":
        caps = [_capability(g) for g in report.gpus]
        names = ", ".join(sorted({g.name for g in report.gpus})) or "this GPU"
        if any(c < (8, 0) for c in caps):
            support["bf16"] = (
                f"bf16 needs an Ampere or newer GPU (compute capability 8.0); {names} is older"
            )
        if not all(c >= (8, 9) for c in caps):
            support["fp8"] = (
                f"fp8 needs a Hopper or Ada GPU (compute capability 8.9 or 9.0, e.g. H100); {names} has none"
            )
    elif accelerator == "tpu":
        support["fp16"] = (
            "fp16 is not supported on TPU; use bf16 (TPU cores compute in bfloat16 natively, "
            "and torch_xla has no fp16 loss scaling)"
        )
        support["fp8"] = (
            "fp8 needs a Hopper-class NVIDIA GPU (torchao's float8 matmuls); this machine has "
            "TPU cores, whose reduced precision is bf16"
        )
    else:
        device = DEVICE_WORDS.get(accelerator, accelerator.upper())
        support["fp8"] = f"fp8 needs a Hopper-class NVIDIA GPU; this machine runs ranks on {device}"
    return support


def _capability(gpu: GpuInfo) -> tuple[int, int]:
    try:
        major, minor = gpu.compute_capability.split(".")
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


def start_method_support(
    platform: str | None = None, available: Sequence[str] | None = None
) -> dict[str, str | None]:
    """Map each start method to None where it can start ranks, else the reason it cannot.

    ``platform`` is ``sys.platform`` and ``available`` multiprocessing's start methods,
    both read from this process when not given (tests pass a faked platform).
    """
    platform = sys.platform if platform is None else platform
    methods = set(multiprocessing.get_all_start_methods() if available is None else available)
    have = ", ".join(sorted(methods)) or "none"
    support: dict[str, str | None] = {}
    for method in START_METHODS:
        if method == "auto":
            support[method] = None
        elif method not in methods:
            support[method] = (
                f"this platform ({platform}) has no {method!r} start method (it has {have})"
            )
        elif method == "fork" and not platform.startswith("linux"):
            # macOS lists fork, but a process forked after its system frameworks were
            # loaded crashes or deadlocks (Python made spawn the default there for this).
            support[method] = (
                f"fork is not safe on this platform ({platform}): a forked process crashes "
                "once system frameworks are loaded"
            )
        else:
            support[method] = None
    return support


def default_num_processes(report: Machine, accelerator: str | None = None) -> int:
    """Ranks a launch starts when nobody chose: one per device, else 2 CPU ranks."""
    accelerator = accelerator or report.accelerator
    if accelerator == "cuda":
        return len(report.gpus) or 1
    if accelerator == "tpu":
        return _tpu_processes(report)
    if accelerator == "mps":
        return 1
    return min(2, report.cpu_count) or 1


def _tpu_processes(report: Machine) -> int:
    """torch_xla starts one process per TPU chip (XLA on the CPU: one)."""
    if report.tpu is not None:
        return report.tpu.processes
    return report.tpu_cores or 1


def max_num_processes(
    report: Machine, accelerator: str | None = None, open_files_limit: int | None = None
) -> int:
    """The most ranks this machine runs at once on ``accelerator`` (see the CPU note above).

    ``open_files_limit`` is the soft RLIMIT_NOFILE of the launching process, read here
    when not given.
    """
    accelerator = accelerator or report.accelerator
    if accelerator == "cuda":
        return len(report.gpus)
    if accelerator == "tpu":
        return _tpu_processes(report)
    if accelerator == "mps":
        return 1
    return min(_cpu_core_limit(report), _fd_limit(open_files_limit))


def _cpu_core_limit(report: Machine) -> int:
    return max(MIN_CPU_RANK_LIMIT, CPU_RANKS_PER_CORE * max(1, report.cpu_count))


def _fd_limit(open_files_limit: int | None) -> int:
    if open_files_limit is None:
        open_files_limit = _open_files_limit()
    if open_files_limit <= 0:  # unlimited
        return sys.maxsize
    return max(1, (open_files_limit - _FDS_KEPT_FREE) // KERNEL_FDS_PER_RANK)


def _open_files_limit() -> int:
    try:
        import resource
    except ImportError:  # Windows: no such limit
        return -1
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return -1 if soft == resource.RLIM_INFINITY else int(soft)


def num_processes_problem(
    value: int,
    report: Machine,
    accelerator: str | None = None,
    open_files_limit: int | None = None,
) -> str | None:
    """Why ``value`` ranks cannot run on ``accelerator`` here (a sentence with the fix), or None."""
    accelerator = accelerator or report.accelerator
    if value < 1:
        return f"num_processes must be at least 1; got {value}"
    limit = max_num_processes(report, accelerator, open_files_limit)
    if accelerator == "tpu":
        return _tpu_num_processes_problem(value, limit)
    if value <= limit:
        return None
    if accelerator == "cuda":
        names = ", ".join(g.name for g in report.gpus)
        return (
            f"num_processes={value} but this machine has {len(report.gpus)} GPU(s) ({names}); "
            f"each rank needs its own GPU. Use num_processes<={limit}, or hardware='cpu' for CPU ranks"
        )
    if accelerator in ("tpu", "mps"):
        device = DEVICE_WORDS[accelerator]
        return (
            f"num_processes={value} is more than this machine's {limit} {device} device(s), and "
            f"each rank needs its own. Use num_processes<={limit}"
        )
    if limit < _cpu_core_limit(report):
        why = (
            f"the kernel holds {KERNEL_FDS_PER_RANK} open files per rank and its open-files "
            f"limit (ulimit -n) is {_open_files_limit_text(open_files_limit)}"
        )
        fix = "Use fewer ranks, or raise the limit (ulimit -n) before starting Jupyter"
    else:
        why = (
            f"{CPU_RANKS_PER_CORE} per core on its {report.cpu_count} core(s), and never fewer "
            f"than {MIN_CPU_RANK_LIMIT}: each CPU rank is a whole Python process with its own "
            "copy of torch, and beyond that ranks only wait for one another"
        )
        fix = f"Use num_processes<={limit}"
    return f"num_processes={value} is more CPU ranks than this machine can run: at most {limit} ({why}). {fix}"


def _tpu_num_processes_problem(value: int, processes: int) -> str | None:
    # torch_xla's xmp.spawn takes nprocs=None (a process per chip) or 1, nothing between.
    if value in (processes, 1):
        return None
    return (
        f"num_processes={value} cannot run on this TPU: torch_xla starts either one process per "
        f"chip, all {processes} of them, or a single process, and refuses any other count "
        f"(xmp.spawn takes nprocs=None or 1). Use num_processes={processes}, or 1"
    )


def _open_files_limit_text(open_files_limit: int | None) -> str:
    return str(_open_files_limit() if open_files_limit is None else open_files_limit)


def num_processes_note(report: Machine, accelerator: str | None = None) -> str:
    """One line a panel shows under its rank-count choice."""
    accelerator = accelerator or report.accelerator
    limit = max_num_processes(report, accelerator)
    if accelerator == "cpu":
        return f"CPU ranks share the {report.cpu_count} core(s); at most {limit}."
    return f"At most {limit}: each rank needs its own {DEVICE_WORDS.get(accelerator, accelerator)}."


def choices(report: Machine) -> dict[str, Any]:
    """What a panel offers: every option, with the reason where the machine cannot run it."""
    return {
        "num_processes": {
            "min": 1,
            "max": max_num_processes(report),
            "default": default_num_processes(report),
            "note": num_processes_note(report),
        },
        "mixed_precision": precision_support(report),
        "start_method": start_method_support(),
    }
