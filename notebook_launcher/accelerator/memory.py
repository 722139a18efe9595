"""``Accelerator.memory_summary()``: this rank's memory, and what its tensors take, as plain data.

The process's reading (peak RSS on a CPU rank, ``max_memory_allocated`` on a CUDA rank)
is the one the launch's dashboard shows. Beside it, the bytes this rank holds of the
prepared models' parameters, gradients and optimizer states: under FSDP2 a rank holds
its shards only, under DDP all of it, so the two are compared here exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from notebook_launcher import rank_memory


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor (FSDP2): this rank's shard
    return to_local() if callable(to_local) else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def tensor_bytes(
    models: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]
) -> dict[str, int]:
    """Bytes this rank holds of parameters (trainable among them), gradients and optimizer state."""
    seen: set[int] = set()
    parameters = trainable = gradients = 0
    for model in models:
        for parameter in model.parameters():
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            size = _nbytes(parameter)
            parameters += size
            if parameter.requires_grad:
                trainable += size
            if parameter.grad is not None:
                gradients += _nbytes(parameter.grad)
    states = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    states += _nbytes(value)
    return {
        "parameters_bytes": parameters,
        "trainable_parameters_bytes": trainable,
        "gradients_bytes": gradients,
        "optimizer_state_bytes": states,
    }


def memory_summary(
    process_index: int,
    models: Iterable[torch.nn.Module],
    optimizers: Iterable[torch.optim.Optimizer],
) -> dict[str, Any]:
    reading = rank_memory.read()
    return {
        "process_index": process_index,
        **reading.as_dict(),
        **tensor_bytes(models, optimizers),
    }
