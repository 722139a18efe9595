"""torch_xla.distributed.parallel_loader, faked: batches move to the device on the way."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from torch_xla import _fake


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


class MpDeviceLoader:
    def __init__(self, loader: Any, device: torch.device, **kwargs: Any) -> None:
        self._loader = loader
        self._device = device

    def __iter__(self) -> Iterator[Any]:
        _fake.calls["MpDeviceLoader"] += 1
        for batch in self._loader:
            yield _to(batch, self._device)

    def __len__(self) -> int:
        return len(self._loader)
