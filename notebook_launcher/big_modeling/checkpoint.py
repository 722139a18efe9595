"""Reading checkpoints tensor by tensor: one safetensors or torch file, sharded files with an
index (the layout of transformers' ``save_pretrained`` and of ``Accelerator.save_model``),
or a folder holding either."""

from __future__ import annotations

import functools
import json
import mmap
import os
import struct
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
    """The file is memory-mapped; each tensor is copied out when read, and its pages are then
    dropped from this process (MADV_DONTNEED), so that a shard being read never counts in
    full towards the memory held."""
    with open(path, "rb") as f:
        header_size = struct.unpack("<Q", f.read(8))[0]
        try:
            header = json.loads(f.read(header_size))
        except ValueError as e:
            raise CheckpointMismatchError(
                f"checkpoint {os.fspath(path)!r} is not a safetensors file (its header does not "
                "parse); pass a file written by safetensors, save_model or save_pretrained."
            ) from e
        start = 8 + header_size
        if os.fstat(f.fileno()).st_size <= start:
            return
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise CheckpointMismatchError(
                    f"{name!r} in {os.fspath(path)!r} has dtype {info['dtype']}, which this loader "
                    "does not read; convert the checkpoint to float32, float16 or bfloat16."
                )
            begin, end = (start + int(i) for i in info["data_offsets"])
            shape = tuple(int(n) for n in info["shape"])
            yield CheckpointTensor(
                name, shape, dtype, functools.partial(_copy_out, mapped, begin, end, dtype, shape)
            )
    finally:
        mapped.close()


def _copy_out(
    mapped: mmap.mmap, begin: int, end: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    if end == begin:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=begin)
    tensor = raw.clone().view(dtype).reshape(shape)
    del raw
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        page = mmap.PAGESIZE
        low = begin // page * page
        high = -(-end // page) * page
        try:
            mapped.madvise(mmap.MADV_DONTNEED, low, min(high, len(mapped)) - low)
        except (OSError, ValueError):
            pass  # only a memory saving
    return tensor


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
            yield CheckpointTensor(
                name, tuple(tensor.shape), tensor.dtype, functools.partial(_itself, tensor)
            )
        del tensor


def _itself(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
