"""Sizes: budgets ("40MB", "2GiB", bytes), the dtypes weights take, and the bytes of a shape."""

from __future__ import annotations

import re
from typing import Union

import torch

from notebook_launcher.byte_units import BYTE_UNITS
from notebook_launcher.errors import BigModelError

Size = Union[int, str]
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def parse_budget(size: Size, what: str = "budget") -> int:
    """Bytes in ``size``: an int, or "40MB", "2GiB" (MB = 10**6 bytes, MiB = 2**20)."""
    if isinstance(size, bool):
        raise BigModelError(
            f"{what}={size!r} is not a size; pass bytes or a string such as '40MB' or '2GiB'."
        )
    if isinstance(size, int):
        if size < 0:
            raise BigModelError(f"{what}={size} is negative; pass a number of bytes of at least 0.")
        return size
    if isinstance(size, float) and size >= 0:
        return int(size)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
    if match is None:
        raise BigModelError(
            f"{what}={size!r} is not a size; pass a number of bytes or a string such as "
            "'40MB', '500MiB' or '2GiB'."
        )
    return int(float(match.group(1)) * BYTE_UNITS[(match.group(2) or "").upper()])


def format_bytes(count: float) -> str:
    """1536 -> '1.5 KiB'; what the plan and the estimates print."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - the loop always returns


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise BigModelError(
            f"dtype={dtype!r} is not a floating dtype this knows; pass a torch dtype or one of "
            f"{sorted(_DTYPES)}."
        )
    return _DTYPES[name]


def target_dtype(tensor_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """Floating weights take ``dtype`` when given; integer and bool tensors keep theirs."""
    return dtype if dtype is not None and tensor_dtype.is_floating_point else tensor_dtype


def nbytes(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * dtype.itemsize
