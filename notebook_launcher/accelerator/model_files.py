"""``save_model``: a model's weights as files for sharing, split into files by size.

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
from typing import TYPE_CHECKING, Any

import torch

from notebook_launcher.accelerator.adapters import is_peft_model, save_adapter
from notebook_launcher.accelerator.wrappers import unwrap
from notebook_launcher.byte_units import BYTE_UNITS
from notebook_launcher.errors import AcceleratorError, CheckpointError

if TYPE_CHECKING:
    from notebook_launcher.accelerator.accelerator_state import AcceleratorState


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
    return int(float(match.group(1)) * BYTE_UNITS[(match.group(2) or "").upper()])


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
        key = (
            pointer,
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        if key in seen:
            continue  # the same weight under a second name (tied weights)
        seen[key] = name
        if pointer in storages or not tensor.is_contiguous():
            tensor = tensor.contiguous().clone()
        else:
            storages.add(pointer)
        kept[name] = tensor
    return kept


def split_into_shards(
    tensors: dict[str, torch.Tensor], max_bytes: int
) -> list[dict[str, torch.Tensor]]:
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
    pattern = re.compile(
        rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?{re.escape(suffix)}(\.index\.json)?"
    )
    for name in os.listdir(directory):
        if pattern.fullmatch(name):
            os.remove(os.path.join(directory, name))


class Saving:
    """``save_model`` (a mixin of the Accelerator); whole training states are checkpointing's."""

    state: AcceleratorState

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
                save_adapter(
                    unwrap(model), state_dict, save_directory, safe_serialization=safe_serialization
                )
                return
            write_model(
                state_dict,
                save_directory,
                max_shard_size=max_shard_size,
                safe_serialization=safe_serialization,
            )
