"""Choosing how ranks are started: a pure function of the kernel's state."""

from __future__ import annotations

import dataclasses
import multiprocessing
import sys

from notebook_launcher.errors import LaunchConfigError

START_METHODS = ("auto", "fork", "forkserver", "spawn")


@dataclasses.dataclass(frozen=True)
class KernelState:
    """What in the calling process decides which start methods are safe."""

    fork_available: bool  # fork exists and is safe on this platform (Linux)
    forkserver_available: bool
    cuda_initialized: bool  # a CUDA context exists: forked children cannot use CUDA
    process_group_initialized: bool  # torch.distributed is initialised here: forks inherit it

    @classmethod
    def detect(cls) -> KernelState:
        methods = multiprocessing.get_all_start_methods()
        torch = sys.modules.get("torch")
        cuda_initialized = bool(torch is not None and torch.cuda.is_initialized())
        dist = sys.modules.get("torch.distributed")
        group_initialized = bool(
            dist is not None and dist.is_available() and dist.is_initialized()
        )
        return cls(
            # macOS lists fork, but forking after system frameworks are loaded crashes.
            fork_available="fork" in methods and sys.platform.startswith("linux"),
            forkserver_available="forkserver" in methods,
            cuda_initialized=cuda_initialized,
            process_group_initialized=group_initialized,
        )


@dataclasses.dataclass(frozen=True)
class StartMethodChoice:
    method: str  # "fork", "forkserver" or "spawn"
    fallback_reason: str | None = None  # set when "auto" could not use fork


def fork_blocker(state: KernelState) -> str | None:
    """Why forking this kernel would give broken ranks, or None when it is safe."""
    if not state.fork_available:
        return f"fork is not safe on this platform ({sys.platform})"
    if state.cuda_initialized:
        return "CUDA was initialised in this kernel, and forked ranks cannot use it"
    if state.process_group_initialized:
        return (
            "a torch.distributed process group is initialised in this kernel "
            "(an Accelerator or init_process_group ran in a cell), and forked ranks would inherit it"
        )
    return None


def choose_start_method(requested: str, state: KernelState) -> StartMethodChoice:
    if requested not in START_METHODS:
        raise LaunchConfigError(
            f"start_method={requested!r} is not a start method; use one of "
            + ", ".join(repr(m) for m in START_METHODS)
            + " ('auto' picks the fastest safe one)."
        )
    blocker = fork_blocker(state)
    if requested == "auto":
        if blocker is None:
            return StartMethodChoice("fork")
        method = "forkserver" if state.forkserver_available else "spawn"
        return StartMethodChoice(method, fallback_reason=blocker)
    if requested == "fork" and blocker is not None:
        raise LaunchConfigError(
            f"start_method='fork' cannot be used: {blocker}. Use start_method='auto' or "
            "'forkserver', which start clean ranks; no kernel restart is needed."
        )
    if requested == "forkserver" and not state.forkserver_available:
        raise LaunchConfigError(
            f"start_method='forkserver' is not available on this platform ({sys.platform}); "
            "use start_method='auto' or 'spawn'."
        )
    return StartMethodChoice(requested)
