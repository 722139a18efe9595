"""Choosing how ranks are started: a pure function of the kernel's state.

Which methods a platform has is a rule of :mod:`notebook_launcher.rules`; what in this
kernel makes fork unsafe is read once per launch into a :class:`KernelState`.
"""

from __future__ import annotations

import _ctypes
import dataclasses
import multiprocessing
import os
import sys
from typing import Callable

from notebook_launcher import rank_env, rules
from notebook_launcher.errors import LaunchConfigError

START_METHODS = rules.START_METHODS

# The CUDA driver's names to the dynamic loader: once a process has it loaded, some library
# may have called cuInit, and a forked child then fails with "Cannot re-initialize CUDA".
# The loader knows a library by its soname however it was loaded (a full path, a compat
# folder, a renamed copy), so asking it by these names finds every loaded driver.
_CUDA_DRIVER_SONAMES = ("libcuda.so.1", "libcuda.so")


def library_loaded(soname: str) -> bool:
    """Whether the dynamic loader has ``soname`` loaded in this process, asked without
    loading it (dlopen's RTLD_NOLOAD): tens of microseconds, where reading
    /proc/self/maps took half a millisecond before every launch."""
    nothing_loaded = getattr(os, "RTLD_NOLOAD", None)
    if nothing_loaded is None or not hasattr(_ctypes, "dlopen"):
        return False  # not a POSIX loader: the platform rule already refuses fork there
    try:
        handle = _ctypes.dlopen(soname, nothing_loaded | os.RTLD_LAZY)
    except OSError:
        return False
    _ctypes.dlclose(handle)  # the probe's own reference
    return True


def cuda_driver_loaded(is_loaded: Callable[[str], bool] | None = None) -> bool:
    """Whether the CUDA driver is loaded in this process, by torch or any other library
    (cupy, numba, jax, bitsandbytes...). Tests pass a fake ``is_loaded``."""
    return any((is_loaded or library_loaded)(name) for name in _CUDA_DRIVER_SONAMES)


@dataclasses.dataclass(frozen=True)
class KernelState:
    """What in the calling process decides which start methods are safe."""

    fork_available: bool = True  # the platform has fork and it is safe there
    forkserver_available: bool = True
    cuda_initialized: bool = False  # torch created a CUDA context here
    process_group_initialized: bool = (
        False  # torch.distributed is initialised here: forks inherit it
    )
    cuda_driver_loaded: bool = False  # some library (not necessarily torch) loaded the CUDA driver
    inside_rank: bool = False  # this process is itself a rank of a launch
    platform: str = "linux"

    @classmethod
    def detect(
        cls,
        platform: str | None = None,
        available: list[str] | None = None,
        is_loaded: Callable[[str], bool] | None = None,
    ) -> KernelState:
        platform = sys.platform if platform is None else platform
        support = rules.start_method_support(
            platform, multiprocessing.get_all_start_methods() if available is None else available
        )
        torch = sys.modules.get("torch")
        cuda_initialized = bool(torch is not None and torch.cuda.is_initialized())
        dist = sys.modules.get("torch.distributed")
        group_initialized = bool(dist is not None and dist.is_available() and dist.is_initialized())
        return cls(
            fork_available=support["fork"] is None,
            forkserver_available=support["forkserver"] is None,
            cuda_initialized=cuda_initialized,
            process_group_initialized=group_initialized,
            cuda_driver_loaded=cuda_driver_loaded(is_loaded),
            inside_rank=rank_env.inside_rank(),
            platform=platform,
        )


@dataclasses.dataclass(frozen=True)
class StartMethodChoice:
    method: str  # "fork", "forkserver" or "spawn"
    fallback_reason: str | None = None  # set when "auto" could not use fork


def fork_blocker(state: KernelState) -> str | None:
    """Why forking this kernel would give broken ranks, or None when it is safe."""
    if not state.fork_available:
        return f"fork is not safe on this platform ({state.platform})"
    if state.cuda_initialized:
        return "CUDA was initialised in this kernel, and forked ranks cannot use it"
    if state.cuda_driver_loaded:
        return (
            "the CUDA driver was initialised in this kernel (libcuda is loaded: "
            "torch.cuda.is_available(), cupy, numba, jax or bitsandbytes do that), and forked "
            "ranks could not use CUDA"
        )
    if state.process_group_initialized:
        return (
            "a torch.distributed process group is initialised in this kernel "
            "(an Accelerator or init_process_group ran in a cell), and forked ranks would inherit it"
        )
    return None


def choose_start_method(requested: str, state: KernelState) -> StartMethodChoice:
    requested_name = rules.canonical(requested)
    if requested_name not in START_METHODS:
        raise LaunchConfigError(
            f"start_method={requested!r} is not a start method; use one of "
            + ", ".join(repr(m) for m in START_METHODS)
            + " ('auto' picks the fastest safe one)."
        )
    blocker = fork_blocker(state)
    if requested_name == "auto":
        if blocker is None:
            return StartMethodChoice("fork")
        method = "forkserver" if state.forkserver_available else "spawn"
        return StartMethodChoice(method, fallback_reason=blocker)
    if requested_name == "fork" and blocker is not None:
        raise LaunchConfigError(
            f"start_method='fork' cannot be used: {blocker}. Use start_method='auto' or "
            "'forkserver', which start clean ranks; no kernel restart is needed."
        )
    if requested_name == "forkserver" and not state.forkserver_available:
        raise LaunchConfigError(
            f"start_method='forkserver' is not available on this platform ({state.platform}); "
            "use start_method='auto' or 'spawn'."
        )
    return StartMethodChoice(str(requested_name))
