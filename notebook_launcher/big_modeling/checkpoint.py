"""Reading checkpoints tensor by tensor: one safetensors or torch file, sharded files with an
index (the layout of transformers' ``save_pretrained`` and of ``Accelerator.save_model``),
or a folder holding either."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from notebook_launcher.errors import CheckpointMismatchError

# Names save_model and save_pretrained give a whole checkpoint, most preferred first.
_FOLDER_ENTRIES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


@dataclass
class CheckpointTensor:
    """A tensor of a checkpoint, known by name, shape and dtype before it is read."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]


def checkpoint_files(checkpoint: str | os.PathLike[str]) -> list[Path]:
    """The files holding the weights, in the order to read them."""
    path = Path(checkpoint)
    if path.is_dir():
        for entry in _FOLDER_ENTRIES:
            if (path / entry).is_file():
                return checkpoint_files(path / entry)
        found = sorted(p.name for p in path.iterdir())[:10]
        raise CheckpointMismatchError(
            f"checkpoint folder {os.fspath(path)!r} holds none of {', '.join(_FOLDER_ENTRIES)} "
            f"(it holds {found or 'nothing'}); pass a folder written by save_model or "
            "save_pretrained, or the path of one weights file."
        )
    if not path.is_file():
        raise CheckpointMismatchError(
            f"checkpoint {os.fspath(path)!r} does not exist; pass a weights file "
            "(.safetensors, .bin), an index .json, or the folder holding them."
        )
    if path.name.endswith(".json"):
        with open(path) as f:
            index = json.load(f)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointMismatchError(
                f"checkpoint index {os.fspath(path)!r} has no 'weight_map'; pass the index "
                "save_model or save_pretrained wrote next to the shards."
            )
        names = list(dict.fromkeys(weight_map.values()))
        missing = [n for n in names if not (path.parent / n).is_file()]
        if missing:
            raise CheckpointMismatchError(
                f"checkpoint index {os.fspath(path)!r} lists shard {missing[0]!r}, which is not "
                f"in {os.fspath(path.parent)!r}; copy every shard next to the index."
            )
        return [path.parent / n for n in names]
    return [path]


def read_file(path: Path) -> Iterator[CheckpointTensor]:
    """Each tensor of one file, read only when asked (safetensors: from a memory map)."""
    if path.suffix == ".safetensors":
        yield from _read_safetensors(path)
    else:
        yield from _read_torch(path)


def _read_safetensors(path: Path) -> Iterator[CheckpointTensor]:
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            view = f.get_slice(name)
            dtype = _SAFETENSORS_DTYPES.get(view.get_dtype())
            if dtype is None:
                tensor = f.get_tensor(name)
                yield CheckpointTensor(name, tuple(tensor.shape), tensor.dtype, lambda t=tensor: t)
                continue
            yield CheckpointTensor(
                name, tuple(view.get_shape()), dtype, lambda f=f, name=name: f.get_tensor(name)
            )


def _read_torch(path: Path) -> Iterator[CheckpointTensor]:
    try:
        # mmap: the file is mapped, not read whole; each tensor is paged in when copied out.
        state = torch.load(os.fspath(path), map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:
        state = torch.load(os.fspath(path), map_location="cpu", weights_only=True)  # legacy format
    if not isinstance(state, dict):
        raise CheckpointMismatchError(
            f"checkpoint {os.fspath(path)!r} holds a {type(state).__name__}, not a state dict; "
            "save model.state_dict() (or use save_model)."
        )
    if "state_dict" in state and isinstance(state["state_dict"], dict) and len(state) <= 3:
        state = state["state_dict"]
    for name in list(state):
        tensor = state.pop(name)
        if isinstance(tensor, torch.Tensor):
            yield CheckpointTensor(name, tuple(tensor.shape), tensor.dtype, lambda t=tensor: t)
        del tensor


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
