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
    blocks = no_split_blocks(model)
    if blocks:
        return blocks
    return [m for m in model.children() if any(True for _ in m.parameters())]


def no_split_class_names(model: torch.nn.Module) -> set[str]:
    """The block classes a transformers model names in ``_no_split_modules``.

    Read from every submodule, so a model inside a wrapper (peft's ``PeftModel`` around
    the transformers model, a user's own module holding one) is seen through.
    """
    names: set[str] = set()
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set)):
            names.update(n for n in declared if isinstance(n, str))
    return names


def no_split_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost submodules whose class is named in ``_no_split_modules``.

    A block whose parameter is also used outside it (a tied embedding and output layer)
    is left to the root: one parameter cannot belong to two units.
    """
    names = no_split_class_names(model)
    if not names:
        return []
    owners: dict[int, set[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(parameter), set()).add(name)
    blocks: list[torch.nn.Module] = []
    taken: list[str] = []
    for prefix, module in model.named_modules():
        if module is model or type(module).__name__ not in names:
            continue
        if any(prefix.startswith(outer + ".") for outer in taken):
            continue  # inside a block already chosen
        if not any(True for _ in module.parameters()):
            continue
        if _shared_outside(module, prefix, owners):
            continue
        taken.append(prefix)
        blocks.append(module)
    return blocks


def _shared_outside(module: torch.nn.Module, prefix: str, owners: dict[int, set[str]]) -> bool:
    for parameter in module.parameters():
        for name in owners.get(id(parameter), ()):
            if not name.startswith(prefix + "."):
                return True
    return False


def shard_model(
    model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin
) -> dict[int, torch.nn.Parameter]:
    """Shard ``model`` in place; returns {id(old parameter): new parameter} for optimizers."""
    from torch.distributed.fsdp import fully_shard

    if all(p.device.type == "cpu" for p in model.parameters()):
        return_freed_buffers()
    before = list(model.parameters())
    # Inner units first: each unit's parameters are gathered only around its own forward.
    for unit in _units(model, plugin):
        fully_shard(unit, reshard_after_forward=plugin.reshard_after_forward)
    fully_shard(model, reshard_after_forward=plugin.reshard_after_forward)
    after = list(model.parameters())
    return {id(old): new for old, new in zip(before, after) if old is not new}


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own default, before it starts raising it


def return_freed_buffers() -> bool:
    """Make glibc give freed large buffers back to the system at once (CPU ranks).

    FSDP2 gathers each unit's full parameters into fresh buffers and frees them after
    the unit's forward and backward. glibc raises its mmap threshold whenever such a
    buffer is freed, so later ones come from the heap and stay resident once freed: a
    CPU rank measured here held more under FSDP2 than under DDP (498 MB against 343 MB
    of growth while training a 8-layer Llama). Fixing the threshold makes every large
    buffer an mmap of its own, returned when freed (171 MB against 336 MB). Returns
    False where the C library is not glibc.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES))


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The unsharded weights on CPU; a collective, so every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _full_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
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
