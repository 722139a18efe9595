"""The weight fetcher: brings a block's offloaded weights to the device that runs it, one
block ahead, on a side thread. For a GPU, disk blocks are read into a small pool of reused
pinned buffers and copied through a side CUDA stream without blocking; for the CPU, a disk
block is a private memory map of its file whose pages the side thread enters into the page
table, so the block computes straight from the page cache, with no copy.

It owns the thread, the streams, the buffers and the offload folder's descriptors, and
holds nothing of the model itself, so that collecting the model can close it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from notebook_launcher.big_modeling.disk_store import DiskStore
from notebook_launcher.errors import OffloadFolderError

THREAD_PREFIX = "big-model-prefetch"
_cuda: Any = torch.cuda  # its Stream and Event are untyped
_KEPT_BUFFERS = 3  # the block running, the one fetched ahead, and one of another size


@dataclass
class Needs:
    """What one block borrows: weights by name from the CPU store, the disk, or another device."""

    device: torch.device
    cpu: list[str] = field(default_factory=list)
    disk: list[str] = field(default_factory=list)
    elsewhere: dict[str, torch.Tensor] = field(default_factory=dict)  # ties across devices

    @property
    def ahead(self) -> bool:
        """Worth a side thread: a map (or read) from disk, or a copy to a GPU."""
        return bool(self.disk) or self.device.type == "cuda"


@dataclass
class Fetched:
    tensors: dict[str, torch.Tensor]
    event: Any = None  # a CUDA event the copies recorded, waited on before use
    buffers: list[torch.Tensor] = field(default_factory=list)  # read buffers, maybe reused
    mapped: bool = False  # some tensors view maps of the offload files


def _sole_owner(buffer: torch.Tensor) -> bool:
    """Whether nothing but ``buffer`` itself views its memory (no output, no autograd graph)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # pragma: no cover - every torch this supports has it
        return False
    # One reference from ``buffer``, one from the storage object made to ask.
    return bool(use_count(buffer.untyped_storage()._cdata) <= 2)


class WeightFetcher:
    def __init__(
        self, needs: dict[int, Needs], cpu: dict[str, torch.Tensor], disk: DiskStore | None
    ) -> None:
        self.needs = needs
        self.cpu = cpu
        self.disk = disk
        self._pool: ThreadPoolExecutor | None = None
        # (block, its fetch, the maps that fetch lets go first)
        self._pending: tuple[int, Future[Fetched], dict[str, torch.Tensor] | None] | None = None
        self._lock = threading.Lock()
        self._streams: dict[torch.device, Any] = {}
        self._free: list[tuple[torch.Tensor, Any]] = []  # (byte buffer, event of its last copy)
        # The last block's mapped weights, let go by the side thread before its next fetch:
        # undoing a map costs about as much as making it. Never more than one block.
        self._unmapping: dict[str, torch.Tensor] | None = None
        self._closed = False
        # Map disk blocks run on the CPU instead of reading them (False: read into the pool
        # of reused buffers, as for a GPU, which reads into pinned memory).
        self.map_disk = True

    # what the hook layer calls ------------------------------------------------------------

    def take(self, key: int) -> Fetched:
        """The weights of block ``key``: the ones fetched ahead if they are these, else now."""
        pending = self._pending
        if pending is not None and pending[0] == key:
            self._pending = None
            return pending[1].result()
        self.drop_pending()  # guessed wrong: those weights are let go, not held
        return self._fetch(key)

    def prefetch(self, key: int) -> None:
        if self._closed or not self.needs[key].ahead:
            return
        self.drop_pending(keep_unmapping=True)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_PREFIX)
        letting_go, self._unmapping = self._unmapping, None
        self._pending = (key, self._pool.submit(self._fetch, key, letting_go), letting_go)

    def drop_pending(self, keep_unmapping: bool = False) -> None:
        """Let the block fetched ahead go (a forward ended, failed, or went elsewhere), and
        the maps of the last block run, unless the next fetch is about to."""
        if not keep_unmapping:
            self._unmapping = None
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending[1].cancel():
            if pending[2] is not None:
                pending[2].clear()  # the fetch that was to let these go will not run
            return
        try:
            fetched = pending[1].result()  # a read under way: one block, then its buffers return
        except Exception:
            return  # the error belongs to a fetch nobody needs any more
        self.release(fetched)

    def pending_count(self) -> int:
        return 0 if self._pending is None else 1

    def release(self, fetched: Fetched) -> None:
        """The block ran: its read buffers go back to the pool, unless something still views
        them (an output that is a view of a weight, or an autograd graph), which keeps them."""
        tensors, fetched.tensors = fetched.tensors, {}
        if fetched.mapped and not self._closed:
            self._unmapping = tensors  # the one before, if still there, is undone here
        else:
            tensors.clear()  # before asking whether anything else views the buffers
        buffers, fetched.buffers = fetched.buffers, []
        reusable = [b for b in buffers if _sole_owner(b)]
        if not reusable or self._closed:
            return
        with self._lock:
            self._free.extend((b, fetched.event) for b in reusable)
            self._free.sort(key=lambda item: -item[0].numel())
            del self._free[_KEPT_BUFFERS:]

    def close(self) -> None:
        """End the thread, close the folder's descriptors, drop the buffers. Runs once, from
        ``remove_hooks`` or when the model is collected."""
        if self._closed:
            return
        self._closed = True
        self.drop_pending()
        if self._pool is not None:
            on_worker = threading.current_thread().name.startswith(THREAD_PREFIX)
            self._pool.shutdown(wait=not on_worker, cancel_futures=True)
            self._pool = None
        if self.disk is not None:
            self.disk.close()
        with self._lock:
            self._free.clear()
            self._streams.clear()

    # the fetch itself ---------------------------------------------------------------------

    def _fetch(self, key: int, letting_go: dict[str, torch.Tensor] | None = None) -> Fetched:
        if letting_go is not None:
            letting_go.clear()  # the last block's maps are undone here, off the model's thread
        needs = self.needs[key]
        pin = needs.device.type == "cuda"
        used: list[torch.Tensor] = []

        def buffer_for(count: int) -> torch.Tensor:
            used.append(self._buffer(count, pin))
            return used[-1]

        tensors: dict[str, torch.Tensor] = {}
        mapped = bool(needs.disk) and self.disk is not None and self.map_disk and not pin
        if mapped and self.disk is not None:
            # Run on the CPU, a block's weights are views of its file mapped afresh: no copy
            # of the bytes, and no buffer that a later block could overwrite under an output.
            try:
                tensors.update(self.disk.map(needs.disk))
            except OffloadFolderError:
                raise
            except OSError:  # a file system that cannot map files: they are read instead
                self.map_disk = mapped = False
        if needs.disk and self.disk is not None and not mapped:
            tensors.update(self.disk.read(needs.disk, pin=pin, buffer_for=buffer_for))
        for name in needs.cpu:
            tensors[name] = self.cpu[name]
        tensors.update(needs.elsewhere)
        if needs.device.type != "cuda":
            return Fetched({n: t.to(needs.device) for n, t in tensors.items()}, None, used, mapped)
        stream = self._stream(needs.device)
        with torch.cuda.stream(stream):
            moved = {n: t.to(needs.device, non_blocking=True) for n, t in tensors.items()}
            event = _cuda.Event()
            event.record(stream)
        return Fetched(moved, event, used)

    def _buffer(self, count: int, pin: bool) -> torch.Tensor:
        with self._lock:
            fitting = [i for i, (b, _e) in enumerate(self._free) if b.numel() >= count]
            if fitting:
                buffer, event = self._free.pop(fitting[-1])  # the smallest that fits
                if event is not None:
                    event.synchronize()  # its last copy to the GPU has finished
                return buffer
        # Fresh memory costs a page fault per page, every time: hence the pool.
        return torch.empty(count, dtype=torch.uint8, pin_memory=pin)

    def _stream(self, device: torch.device) -> Any:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = _cuda.Stream(device)
            return self._streams[device]
