"""Build a model without memory for its weights: ``init_empty_weights`` and ``init_on_device``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Inside this block, models are built on the ``meta`` device: shapes and dtypes, no memory.

    A 70B-parameter model builds in a second this way; load its weights afterwards with
    :func:`load_checkpoint_and_dispatch`. Buffers (position ids, rotary tables) are built
    for real unless ``include_buffers=True``: they are small, and often absent from checkpoints.
    """
    with init_on_device(torch.device("meta"), include_buffers=bool(include_buffers)):
        yield


@contextlib.contextmanager
def init_on_device(
    device: torch.device | str, include_buffers: bool | None = None
) -> Iterator[None]:
    """Inside this block, every parameter a module registers is created on ``device``
    (and every buffer too with ``include_buffers=True``)."""
    device = torch.device(device)
    if include_buffers:
        # The default device catches every tensor made inside, weights and buffers alike.
        with device:
            yield
        return
    register_parameter = torch.nn.Module.register_parameter

    def on_device(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register_parameter(module, name, param)
        if param is not None and param.device != device:
            kind = type(param)
            extra: dict[str, Any] = dict(param.__dict__)
            moved = kind(param.to(device), requires_grad=param.requires_grad)
            moved.__dict__.update(extra)
            module._parameters[name] = moved

    torch.nn.Module.register_parameter = on_device  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
