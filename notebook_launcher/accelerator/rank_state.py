"""Who this process is in a launch: rank, world size, device; and its process group.

Everything is read from the environment contract (``notebook_launcher.rank_env``), so the
same code works in a rank of our launcher, under ``torchrun`` and in one plain process
(world size 1, where no process group is needed). Nothing here initialises CUDA: the
device kind comes from the launcher's variables or the driver's tool (``nvidia-smi``),
and ``torch.cuda`` is first touched when a model is moved to the device.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import warnings
from collections.abc import Mapping
from typing import Callable

import torch
import torch.distributed as dist

from notebook_launcher import hardware
from notebook_launcher.errors import RankEnvironmentError
from notebook_launcher.rank_env import ACCELERATOR, USE_CPU

DEVICE_KINDS = ("cuda", "cpu", "tpu", "mps")
_BACKENDS = {"cuda": "nccl", "cpu": "gloo", "mps": "gloo", "tpu": "xla"}
_TRUE = ("1", "true", "yes", "on")


class DistributedType(str, enum.Enum):
    """How the ranks cooperate; the values are accelerate's, so string comparisons transfer.

    This core runs NO, MULTI_CPU, MULTI_GPU, FSDP and XLA; accelerate's other members exist
    so that code comparing against them (``state.distributed_type in (MULTI_NPU, ...)``)
    runs unchanged.
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    XLA = "XLA"
    DEEPSPEED = "DEEPSPEED"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


def choose_distributed_type(
    device_kind: str, world_size: int, fully_sharded: bool
) -> DistributedType:
    """The one place that maps where ranks run to how they cooperate (a new device kind adds a line)."""
    if device_kind == "tpu":
        return DistributedType.XLA
    if world_size == 1:
        return DistributedType.NO
    if fully_sharded:
        return DistributedType.FSDP
    return DistributedType.MULTI_GPU if device_kind == "cuda" else DistributedType.MULTI_CPU


@dataclasses.dataclass(frozen=True)
class RankState:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device_kind: str  # one of DEVICE_KINDS
    device: torch.device

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0

    @property
    def backend(self) -> str:
        return _BACKENDS[self.device_kind]


def choose_device_kind(
    *,
    cpu: bool,
    environ: Mapping[str, str],
    detect_hardware: Callable[[], hardware.HardwareReport],
    cuda_built: bool,
) -> str:
    """Where this process computes: an explicit ``cpu=True``, else the launcher's choice, else the hardware."""
    if cpu:
        return "cpu"
    placed = environ.get(ACCELERATOR, "").strip().lower()
    if placed:
        if placed not in DEVICE_KINDS:
            raise RankEnvironmentError(
                f"{ACCELERATOR}={placed!r} is not a device kind this core knows "
                f"({', '.join(DEVICE_KINDS)}); it is set by notebook_launcher: unset it or "
                "start the ranks with notebook_launcher(...)."
            )
        if placed == "cuda" and not cuda_built:
            raise RankEnvironmentError(
                f"This rank was placed on a CUDA GPU but torch {torch.__version__} is a build "
                "without CUDA; install a CUDA build of torch, or launch on CPU."
            )
        return placed
    if environ.get(USE_CPU, "").strip().lower() in _TRUE:
        return "cpu"
    kind = detect_hardware().accelerator
    if kind == "cuda" and not cuda_built:
        warnings.warn(
            f"This machine has an NVIDIA GPU but torch {torch.__version__} has no CUDA "
            "support, so training runs on the CPU; install a CUDA build of torch to use the GPU.",
            stacklevel=3,
        )
        return "cpu"
    return kind


def _int_variable(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise RankEnvironmentError(
            f"{name}={raw!r} is not an integer; it should be set by the launcher "
            "(notebook_launcher or torchrun): unset it to run as a single process."
        ) from None


def read_rank_numbers(environ: Mapping[str, str]) -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun's variables."""
    if dist.is_available() and dist.is_initialized():
        # Someone (the user, a library) already set the group up: it is the truth.
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = _int_variable(environ, "LOCAL_RANK", rank)
        local_world_size = _int_variable(environ, "LOCAL_WORLD_SIZE", world_size)
        return rank, local_rank, world_size, local_world_size
    world_size = _int_variable(environ, "WORLD_SIZE", 1)
    if world_size > 1 and "RANK" not in environ:
        raise RankEnvironmentError(
            f"WORLD_SIZE={world_size} but RANK is not set; start the ranks with "
            "notebook_launcher(...) or torchrun, which set both."
        )
    rank = _int_variable(environ, "RANK", 0)
    local_rank = _int_variable(environ, "LOCAL_RANK", rank)
    local_world_size = _int_variable(environ, "LOCAL_WORLD_SIZE", world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise RankEnvironmentError(
            f"RANK={rank} and WORLD_SIZE={world_size} are inconsistent (need 0 <= RANK < "
            "WORLD_SIZE); they are set by the launcher: unset both to run as a single process."
        )
    return rank, local_rank, world_size, local_world_size


def device_for(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        # A torch.device object does not touch the driver; CUDA starts at the first .to().
        return torch.device("cuda", local_rank)
    if kind == "tpu":
        from notebook_launcher.accelerator import xla

        return xla.acquire_device()
    return torch.device(kind)


def read_rank_state(cpu: bool = False, environ: Mapping[str, str] | None = None) -> RankState:
    env = os.environ if environ is None else environ
    kind = choose_device_kind(
        cpu=cpu,
        environ=env,
        detect_hardware=hardware.detect,
        cuda_built=torch.version.cuda is not None,
    )
    if kind == "tpu":
        from notebook_launcher.accelerator import xla

        # The device first: torch_xla knows the replica numbers once its runtime runs.
        device = xla.acquire_device()
        rank, local_rank, world_size, local_world_size = xla.rank_numbers()
    else:
        rank, local_rank, world_size, local_world_size = read_rank_numbers(env)
        device = device_for(kind, local_rank)
    return RankState(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        device_kind=kind,
        device=device,
    )


def init_process_group_if_needed(
    state: RankState, environ: Mapping[str, str] | None = None
) -> bool:
    """Join the ranks' process group when there are several ranks and none exists yet.

    Returns True when this call created the group (so ``end_training`` may destroy it).
    """
    if state.world_size == 1 or dist.is_initialized():
        return False
    env = os.environ if environ is None else environ
    if state.device_kind == "tpu":
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)
        import torch_xla.runtime as xr

        if xr.addressable_device_count() > 1:
            # v2/v3: replicas are threads of one process, which can hold one default group;
            # the core's collectives go through torch_xla, which needs none.
            return False

        dist.init_process_group("xla", init_method="xla://")
        return True
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise RankEnvironmentError(
            f"WORLD_SIZE={state.world_size} but {' and '.join(missing)} not set, so rank "
            f"{state.rank} cannot find the others; start the ranks with notebook_launcher(...) "
            "or torchrun, which set them."
        )
    if state.device_kind == "cuda":
        # NCCL binds each rank to the current device: choose it before the group exists.
        torch.cuda.set_device(state.device)
    dist.init_process_group(state.backend)
    return True
