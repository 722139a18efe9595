"""The environment every rank sees: torchrun's contract plus what accelerate reads.

The launcher writes it; the training core and any third-party code in the rank
(raw ``torch.distributed``, Hugging Face accelerate, transformers' Trainer) read it.
"""

from __future__ import annotations

import functools
import os
import socket
from types import ModuleType
from typing import Any

from notebook_launcher.after_import import after_import

# Set in every rank; its presence means "this process is a rank of a launch".
LAUNCH_ID = "NOTEBOOK_LAUNCHER_LAUNCH_ID"
# "cuda", "tpu", "mps" or "cpu": where the launcher placed this rank.
ACCELERATOR = "NOTEBOOK_LAUNCHER_ACCELERATOR"
MIXED_PRECISION = "ACCELERATE_MIXED_PRECISION"
USE_CPU = "ACCELERATE_USE_CPU"


def rank_environment(
    *,
    launch_id: str,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    group_rank: int,
    master_addr: str,
    master_port: int,
    mixed_precision: str,
    accelerator: str,
    threads_per_rank: int | None,
    environ: dict[str, str] | None = None,
) -> dict[str, str]:
    """The variables to set in one rank (on top of the kernel's environment)."""
    env = dict(os.environ if environ is None else environ)
    rank_vars = {
        LAUNCH_ID: launch_id,
        ACCELERATOR: accelerator,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(group_rank),
        "NODE_RANK": str(group_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        # The kernel hosts the rendezvous store (as torchrun's agent does), so no rank
        # has to win a race for the port and the store can listen on loopback only.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        MIXED_PRECISION: mixed_precision,
        "PYTHONUNBUFFERED": "1",
    }
    if accelerator == "cpu":
        rank_vars[USE_CPU] = "true"
    else:
        env.pop(USE_CPU, None)
    if threads_per_rank is not None and "OMP_NUM_THREADS" not in env:
        rank_vars["OMP_NUM_THREADS"] = str(threads_per_rank)
    if _is_loopback(master_addr) and "GLOO_SOCKET_IFNAME" not in env:
        loopback = loopback_interface()
        if loopback:
            # Gloo otherwise resolves the hostname, which fails in some containers.
            rank_vars["GLOO_SOCKET_IFNAME"] = loopback
    env.update(rank_vars)
    return env


_ACCELERATE_STATE = "accelerate.state"
_TRUE = ("1", "true", "yes", "on")


def accelerate_sees_every_cpu_rank(
    environ: dict[str, str] | os._Environ[str] | None = None,
) -> None:
    """In a CPU rank, Hugging Face accelerate's ``PartialState()`` sees every rank.

    accelerate chooses MULTI_CPU only from its ``cpu`` argument: no environment variable
    reaches a bare ``PartialState()`` (ACCELERATE_USE_CPU is read by its AcceleratorState
    alone), so one made without ``cpu=True`` would see one process, and, being a
    process-wide singleton, would make the next ``accelerate.Accelerator()`` train the whole
    data alone. In a CPU rank ``cpu=True`` is the truth, so it is made the default there:
    now if accelerate is loaded already, else when it is first imported. Nothing is
    imported here and nothing changes outside the rank.
    """
    env = os.environ if environ is None else environ
    if env.get(USE_CPU, "").strip().lower() not in _TRUE:
        return
    after_import(_ACCELERATE_STATE, _default_to_cpu)


def _default_to_cpu(module: ModuleType) -> None:
    cls = getattr(module, "PartialState", None)
    init = getattr(cls, "__init__", None)
    if cls is None or init is None or getattr(init, "_cpu_rank_default", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, cpu: bool = True, **kwargs: Any) -> None:
        init(self, True, **kwargs)

    __init__._cpu_rank_default = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def inside_rank(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    return LAUNCH_ID in (os.environ if environ is None else environ)


def _is_loopback(address: str) -> bool:
    return address in ("localhost", "::1") or address.startswith("127.")


def loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        if name in ("lo", "lo0"):
            return name
    return None
