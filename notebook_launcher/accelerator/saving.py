"""``save_model`` (weights for sharing, split into files by size) and ``save_state`` hooks.

Named and laid out as in accelerate and transformers: ``model.safetensors`` (or
``pytorch_model.bin``), and when the weights exceed ``max_shard_size``,
``model-00001-of-0000N.safetensors`` files with a ``model.safetensors.index.json`` that maps
each weight to its file, so ``from_pretrained`` and ``load_checkpoint_in_model`` read them.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from notebook_launcher.accelerator.adapters import is_peft_model, save_adapter
from notebook_launcher.accelerator.wrappers import unwrap
from notebook_launcher.errors import AcceleratorError, CheckpointError

if TYPE_CHECKING:
    from notebook_launcher.accelerator.accelerator_state import AcceleratorState

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or "10GB", "500MB", "2GiB" (GB = 10**9 bytes, GiB = 2**30)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
    if isinstance(size, bool) or match is None or float(match.group(1)) <= 0:
        raise AcceleratorError(
            f"max_shard_size={size!r} is not a size; pass a number of bytes or a string such as "
            "'10GB', '500MB' or '2GiB'."
        )
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def _without_aliases(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors to write: tied weights (views of one storage) kept once, under their first name.

    safetensors refuses tensors that share memory; a tensor sharing memory in another way is
    copied out, so every file holds plain, separate tensors.
    """
    seen: dict[tuple[Any, ...], str] = {}
    storages: set[int] = set()
    kept: dict[str, torch.Tensor] = OrderedDict()
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        tensor = tensor.detach()
        if tensor.device.type == "meta":
            continue
        pointer = tensor.untyped_storage().data_ptr()
        key = (pointer, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if key in seen:
            continue  # the same weight under a second name (tied weights)
        seen[key] = name
        if pointer in storages or not tensor.is_contiguous():
            tensor = tensor.contiguous().clone()
        else:
            storages.add(pointer)
        kept[name] = tensor
    return kept


def split_into_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors, each at most ``max_bytes`` (a bigger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [OrderedDict()]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append(OrderedDict())
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_model(
    state_dict: dict[str, Any],
    save_directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str,
    safe_serialization: bool,
) -> list[str]:
    """Write the weights into ``save_directory`` as one file or several; returns the file names."""
    directory = os.fspath(save_directory)
    if os.path.isfile(directory):
        raise CheckpointError(
            f"save_model(..., save_directory={directory!r}): that is a file; pass a folder "
            "(it is created if missing)."
        )
    os.makedirs(directory, exist_ok=True)
    max_bytes = parse_size(max_shard_size)
    tensors = _without_aliases(state_dict)
    shards = split_into_shards(tensors, max_bytes)
    stem, suffix = ("model", ".safetensors") if safe_serialization else ("pytorch_model", ".bin")
    _remove_previous_files(directory, stem, suffix)
    if len(shards) == 1:
        names = [f"{stem}{suffix}"]
    else:
        total = len(shards)
        names = [f"{stem}-{i + 1:05d}-of-{total:05d}{suffix}" for i in range(total)]
    for name, shard in zip(names, shards):
        path = os.path.join(directory, name)
        if safe_serialization:
            from safetensors.torch import save_file

            save_file({k: v.cpu() for k, v in shard.items()}, path, metadata={"format": "pt"})
        else:
            torch.save({k: v.cpu() for k, v in shard.items()}, path)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {key: name for name, shard in zip(names, shards) for key in shard},
        }
        with open(os.path.join(directory, f"{stem}{suffix}.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return names


def _remove_previous_files(directory: str, stem: str, suffix: str) -> None:
    # Shards of an earlier, differently split save would be read together with the new ones.
    pattern = re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?{re.escape(suffix)}(\.index\.json)?")
    for name in os.listdir(directory):
        if pattern.fullmatch(name):
            os.remove(os.path.join(directory, name))


class Saving:
    """``save_model`` and the ``save_state`` / ``load_state`` hooks (a mixin of the Accelerator)."""

    state: AcceleratorState
    _save_state_pre_hooks: dict[int, Callable[..., None]]
    _load_state_pre_hooks: dict[int, Callable[..., None]]

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        raise NotImplementedError

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """The model's full weights into ``save_directory``, split into files of at most
        ``max_shard_size`` (safetensors, or ``torch.save`` with safe_serialization=False).
        A peft model (LoRA) writes its adapter alone, as its ``save_pretrained`` does.

        Call it on every rank (FSDP2 gathers the weights); the main process writes.
        """
        if safe_serialization:
            try:
                import safetensors.torch  # noqa: F401
            except ImportError as e:
                raise AcceleratorError(
                    "save_model(..., safe_serialization=True) needs the safetensors package: "
                    "pip install safetensors, or pass safe_serialization=False."
                ) from e
        parse_size(max_shard_size)  # a bad size fails on every rank, before any collective
        state_dict = self.get_state_dict(model)
        if self.state.is_main_process:
            if is_peft_model(unwrap(model)):  # the adapter alone, as peft saves it
                save_adapter(unwrap(model), state_dict, save_directory, safe_serialization=safe_serialization)
                return
            write_model(
                state_dict,
                save_directory,
                max_shard_size=max_shard_size,
                safe_serialization=safe_serialization,
            )

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs in ``save_state`` before anything is written.

        ``weights`` holds each prepared model's state dict; removing an entry
        (``weights.pop()``) leaves that model out of the default saving, so the hook can
        save it its own way. Returns a handle whose ``remove()`` unregisters the hook.
        """
        handle = RemovableHandle(self._save_state_pre_hooks)
        self._save_state_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(models, input_dir)`` runs in ``load_state`` before anything is read.

        Removing a model from ``models`` (``models.pop()``) leaves it out of the default
        loading. Returns a handle whose ``remove()`` unregisters the hook.
        """
        handle = RemovableHandle(self._load_state_pre_hooks)
        self._load_state_pre_hooks[handle.id] = hook
        return handle


def run_save_hooks(
    hooks: dict[int, Callable[..., None]],
    models: list[torch.nn.Module],
    weights: tuple[list[Any], list[dict[str, Any]]],
    output_dir: str | os.PathLike[str],
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Call the save hooks; the models whose state dicts a hook removed are not saved."""
    if not hooks:
        return weights
    to_save, optimizers = weights
    state_dicts = [m.state_dict() if isinstance(m, torch.nn.Module) else m for m in to_save]
    kept = list(state_dicts)
    for hook in list(hooks.values()):
        hook(models, kept, os.fspath(output_dir))
    remaining = [
        item for item, sd in zip(to_save, state_dicts) if any(sd is k for k in kept)
    ]
    return remaining, optimizers


def run_load_hooks(
    hooks: dict[int, Callable[..., None]],
    models: list[torch.nn.Module],
    input_dir: str | os.PathLike[str],
) -> list[torch.nn.Module]:
    """Call the load hooks on a copy of the model list; returns the models left to load."""
    remaining = list(models)
    for hook in list(hooks.values()):
        hook(remaining, os.fspath(input_dir))
    return remaining


def loader_states(source: Path, count: int, rank: int) -> list[dict[str, Any]]:
    """The saved positions of ``count`` prepared loaders (``sampler.bin``, ``sampler_1.bin``, ...).

    The main process writes them; every rank gets rank 0's copy, so ranks whose folders
    are not shared (each its own temporary folder) resume at the same position as well.
    """
    from notebook_launcher.accelerator import operations

    def read() -> list[dict[str, Any]]:
        names = ["sampler.bin"] + [f"sampler_{i}.bin" for i in range(1, count)]
        return [torch.load(source / n, map_location="cpu", weights_only=False) for n in names[:count]]

    if count == 0:
        return []
    if not operations.is_distributed():
        return read()
    shared: list[Any] = [None]
    if rank == 0:
        try:
            shared[0] = read()
        except FileNotFoundError as e:
            shared[0] = e
    operations.broadcast_object_list(shared, from_process=0)
    if isinstance(shared[0], BaseException):
        raise CheckpointError(
            f"load_state({os.fspath(source)!r}): rank 0 found no saved loader position there "
            f"({shared[0]}); pass the folder save_state wrote."
        ) from shared[0]
    return list(shared[0])
