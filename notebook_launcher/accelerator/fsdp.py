"""FSDP2 (``torch.distributed.fsdp.fully_shard``) as an alternative to DDP.

Parameters become DTensor shards; each rank keeps 1/world_size of them. Imported lazily
so that DDP users never load the FSDP machinery.
"""

from __future__ import annotations

from typing import Any

import torch

from notebook_launcher.accelerator.kwargs import FullyShardedDataParallelPlugin


def is_fully_sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _units(model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin) -> list[torch.nn.Module]:
    if plugin.shard_module_filter is not None:
        chosen = plugin.shard_module_filter
        return [m for m in model.modules() if m is not model and chosen(m)]
    if plugin.shard_module_types is not None:
        types = plugin.shard_module_types
        return [m for m in model.modules() if m is not model and isinstance(m, types)]
    return [m for m in model.children() if any(True for _ in m.parameters())]


def shard_model(
    model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin
) -> dict[int, torch.nn.Parameter]:
    """Shard ``model`` in place; returns {id(old parameter): new parameter} for optimizers."""
    from torch.distributed.fsdp import fully_shard

    before = list(model.parameters())
    # Inner units first: each unit's parameters are gathered only around its own forward.
    for unit in _units(model, plugin):
        fully_shard(unit, reshard_after_forward=plugin.reshard_after_forward)
    fully_shard(model, reshard_after_forward=plugin.reshard_after_forward)
    after = list(model.parameters())
    return {id(old): new for old, new in zip(before, after) if old is not new}


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The unsharded weights on CPU; a collective, so every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _full_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's unsharded state on rank 0's CPU (empty elsewhere); a collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_full_options())


def load_full_state_dict(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Shard full weights (read by every rank) into ``model``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True)
    )
