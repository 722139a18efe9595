"""torch_xla.distributed.parallel_loader, faked with torch_xla 2.9's behaviour.

As the real one: a daemon thread reads the wrapped loader into a bounded queue; an
exception there escapes that thread (Python prints it) and the consumer sees the data
end, as if the epoch were over; ``close()`` unblocks and joins the thread.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

import torch

import torch_xla
from torch_xla import _fake


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


class _Queue:
    """Bounded; closing the read side releases a blocked writer, the write side a reader."""

    def __init__(self, maxsize: int) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._maxsize = maxsize
        self._changed = threading.Condition()
        self._reading_closed = False
        self._writing_closed = False

    def put(self, item: Any) -> None:
        with self._changed:
            while len(self._items) >= self._maxsize and not self._reading_closed:
                self._changed.wait()
            if not self._reading_closed:
                self._items.append(item)
                self._changed.notify_all()

    def get(self) -> Any:
        with self._changed:
            while not self._items and not self._writing_closed:
                self._changed.wait()
            item = self._items.popleft() if self._items else None
            self._changed.notify_all()
            return item

    def close(self) -> None:
        with self._changed:
            self._reading_closed = self._writing_closed = True
            self._changed.notify_all()

    def close_write(self) -> None:
        with self._changed:
            self._writing_closed = True
            self._changed.notify_all()


class PerDeviceLoader:
    def __init__(self, loader: ParallelLoader, device: torch.device) -> None:
        self._loader = loader
        self._device = device

    def __iter__(self) -> PerDeviceLoader:
        return self

    def __next__(self) -> Any:
        torch_xla.sync()
        item = self._loader._queue.get()
        if item is None:
            raise StopIteration
        return _to(item, self._device)

    def __len__(self) -> int:
        return len(self._loader._cpu_loader)


class ParallelLoader:
    def __init__(
        self,
        cpu_loader: Any,
        devices: list[Any],
        batchdim: int = 0,
        batches_per_execution: int = 1,
        loader_prefetch_size: int = 16,
        device_prefetch_size: int = 8,
        host_to_device_transfer_threads: int = 1,
        input_sharding: Any = None,
    ) -> None:
        _fake.calls["ParallelLoader"] += 1
        self._cpu_loader = cpu_loader
        self._devices = [torch.device(d) for d in devices]
        self._done = False
        self._queue = _Queue(loader_prefetch_size + device_prefetch_size)
        self._thread = threading.Thread(target=self._loader_worker, daemon=True)
        self._thread.start()

    def per_device_loader(self, device: Any) -> PerDeviceLoader:
        return PerDeviceLoader(self, torch.device(device))

    def close(self) -> None:
        self._done = True
        self._queue.close()
        self._thread.join()

    def _loader_worker(self) -> None:
        batches = iter(self._cpu_loader)
        try:
            while not self._done:
                try:
                    batch = next(batches)  # an exception ends this thread, unseen by the reader
                except StopIteration:
                    break
                self._queue.put(batch)
        finally:
            self._queue.close_write()


class MpDeviceLoader:
    def __init__(self, loader: Any, device: torch.device, **kwargs: Any) -> None:
        self._loader = loader
        self._device = device
        self._kwargs = kwargs
        self._parallel_loader: ParallelLoader | None = None

    def __iter__(self) -> Iterator[Any]:
        _fake.calls["MpDeviceLoader"] += 1
        if self._parallel_loader is not None:
            self._parallel_loader.close()
        self._parallel_loader = ParallelLoader(self._loader, [self._device], **self._kwargs)
        return self._parallel_loader.per_device_loader(self._device)

    def __len__(self) -> int:
        return len(self._loader)
