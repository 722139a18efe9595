"""Running a dispatched model: each block brings its weights to the device that runs it just
before its forward, and lets them go after. Offloaded weights come one block ahead, on a side
thread (and on a GPU through a side CUDA stream, from pinned memory, without blocking), while
the current block computes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from notebook_launcher.big_modeling.placement import CPU_STORE, DISK, OffloadState, current
from notebook_launcher.big_modeling.sizes import Slot, Weight


@dataclass
class Block:
    """One entry of the device map while the model runs: a module, the device that runs it,
    and the weights it must borrow for its forward (offloaded, or living on another device)."""

    name: str
    module: torch.nn.Module
    device: torch.device
    borrowed: list[Weight] = field(default_factory=list)
    slots: dict[str, list[Slot]] = field(default_factory=dict)  # weight name -> its slots here
    moves_inputs: bool = False
    skip_keys: frozenset[str] = frozenset()  # keyword arguments passed on where they are

    @property
    def needs_thread(self) -> bool:
        return self.device.type == "cuda" or any(w.name in self._disk for w in self.borrowed)

    _disk: set[str] = field(default_factory=set)


@dataclass
class Fetched:
    tensors: dict[str, torch.Tensor]
    event: Any = None  # a CUDA event the copies recorded, waited on before use
    buffers: list[torch.Tensor] = field(
        default_factory=list
    )  # read buffers, reused after the block


_KEPT_BUFFERS = 3  # the block running, the one fetched ahead, and one spare


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True) if value.device != device else value
    if isinstance(value, (list, tuple)):
        moved = [_move(v, device) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    if isinstance(value, dict):
        return (
            type(value)((k, _move(v, device)) for k, v in value.items())
            if type(value) is dict
            else _move_mapping(value, device)
        )
    return value


def _move_mapping(value: Any, device: torch.device) -> Any:
    for key in list(value.keys()):
        value[key] = _move(value[key], device)
    return value


def _first_device(value: Any) -> torch.device | None:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, (list, tuple)):
        for v in value:
            found = _first_device(v)
            if found is not None:
                return found
    if isinstance(value, dict):
        for v in value.values():
            found = _first_device(v)
            if found is not None:
                return found
    return None


class Runner:
    """The hooks of one dispatched model and the thread that fetches weights ahead."""

    def __init__(
        self,
        model: torch.nn.Module,
        blocks: list[Block],
        state: OffloadState,
        homes: dict[str, str],
        io_same_device: bool,
    ) -> None:
        self.model = model
        self.blocks = blocks
        self.state = state
        self.homes = homes
        self.handles: list[RemovableHandle] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[Block, Future[Fetched]] | None = None
        self._next: dict[int, Block] = {}  # learned: which borrowing block ran after which
        self._last: Block | None = None
        self._saved: dict[int, list[tuple[Slot, torch.Tensor | None]]] = {}
        self._lock = threading.Lock()
        self._streams: dict[torch.device, Any] = {}
        self._free: list[tuple[torch.Tensor, Any]] = []  # (byte buffer, event of its last copy)
        self._lent: dict[int, Fetched] = {}
        borrowing = [b for b in blocks if b.borrowed]
        for position, block in enumerate(borrowing):
            self._next[id(block)] = borrowing[(position + 1) % len(borrowing)]
            block._disk = {w.name for w in block.borrowed if homes[w.name] == DISK}
        for block in blocks:
            if block.borrowed or block.moves_inputs:
                self.handles.append(
                    block.module.register_forward_pre_hook(self._before(block), with_kwargs=True)
                )
            if block.borrowed:
                self.handles.append(
                    block.module.register_forward_hook(self._after(block), always_call=True)
                )
        if io_same_device:
            self.handles.append(
                model.register_forward_pre_hook(self._remember_input_device, with_kwargs=True)
            )
            self.handles.append(model.register_forward_hook(self._outputs_back))
        self._input_device: torch.device | None = None

    # fetching ---------------------------------------------------------------------------

    def _fetch(self, block: Block) -> Fetched:
        names_disk = [w.name for w in block.borrowed if w.name in block._disk]
        pin = block.device.type == "cuda"
        used: list[torch.Tensor] = []

        def buffer_for(count: int) -> torch.Tensor:
            used.append(self._buffer(count, pin))
            return used[-1]

        tensors = (
            self.state.disk.read(names_disk, pin=pin, buffer_for=buffer_for)
            if names_disk and self.state.disk
            else {}
        )
        for weight in block.borrowed:
            if weight.name in tensors:
                continue
            if self.homes[weight.name] == CPU_STORE:
                tensors[weight.name] = self.state.cpu[weight.name]
            else:  # lives on another device (a tie across devices)
                tensors[weight.name] = current(weight)
        if block.device.type != "cuda":
            return Fetched({n: t.to(block.device) for n, t in tensors.items()}, None, used)
        stream = self._stream(block.device)
        with torch.cuda.stream(stream):
            moved = {n: t.to(block.device, non_blocking=True) for n, t in tensors.items()}
            event = torch.cuda.Event()
            event.record(stream)
        return Fetched(moved, event, used)

    def _buffer(self, count: int, pin: bool) -> torch.Tensor:
        with self._lock:
            for position, (buffer, event) in enumerate(self._free):
                if buffer.numel() >= count:
                    del self._free[position]
                    if event is not None:
                        event.synchronize()  # its last copy to the GPU has finished
                    return buffer
        return torch.empty(count, dtype=torch.uint8, pin_memory=pin)

    def _give_back(self, fetched: Fetched) -> None:
        # Only without autograd: a graph could still hold views of the weights read into them.
        if not fetched.buffers or torch.is_grad_enabled():
            return
        with self._lock:
            self._free.extend((b, fetched.event) for b in fetched.buffers)
            self._free.sort(key=lambda item: -item[0].numel())
            del self._free[_KEPT_BUFFERS:]

    def _stream(self, device: torch.device) -> Any:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            return self._streams[device]

    def _prefetch(self, block: Block) -> None:
        if not block.needs_thread:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="big-model-prefetch")
        self._pending = (block, self._pool.submit(self._fetch, block))

    def _take(self, block: Block) -> Fetched:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is block:
            return pending[1].result()
        if pending is not None:
            pending[1].cancel()  # guessed wrong: its weights are dropped, not held
        return self._fetch(block)

    # hooks ------------------------------------------------------------------------------

    def _before(self, block: Block) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if block.borrowed:
                self._lend(block)
            if block.moves_inputs:
                moved = {
                    k: v if k in block.skip_keys else _move(v, block.device)
                    for k, v in kwargs.items()
                }
                return _move(args, block.device), moved
            return None

        return hook

    def _lend(self, block: Block) -> None:
        if self._last is not None and self._last is not block:
            self._next[id(self._last)] = block
        self._last = block
        fetched = self._take(block)
        if fetched.event is not None:
            main = torch.cuda.current_stream(block.device)
            main.wait_event(fetched.event)
            for tensor in fetched.tensors.values():
                tensor.record_stream(main)
        saved: list[tuple[Slot, torch.Tensor | None]] = []
        for weight in block.borrowed:
            tensor = fetched.tensors[weight.name]
            value: torch.Tensor = (
                torch.nn.Parameter(tensor, requires_grad=False) if weight.is_parameter else tensor
            )
            for slot in block.slots[weight.name]:
                table = slot.module._parameters if slot.is_parameter else slot.module._buffers
                saved.append((slot, table[slot.attr]))
                table[slot.attr] = value  # type: ignore[assignment]
        self._saved[id(block)] = saved
        self._lent[id(block)] = fetched
        following = self._next.get(id(block))
        if following is not None and following is not block:
            self._prefetch(following)

    def _after(self, block: Block) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            for slot, previous in reversed(self._saved.pop(id(block), [])):
                table = slot.module._parameters if slot.is_parameter else slot.module._buffers
                table[slot.attr] = previous  # type: ignore[assignment]
            fetched = self._lent.pop(id(block), None)
            if fetched is not None:
                self._give_back(fetched)

        return hook

    def _remember_input_device(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        self._input_device = _first_device((args, kwargs))

    def _outputs_back(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self._input_device is None:
            return None
        return _move(output, self._input_device)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self._pending is not None:
            self._pending[1].cancel()
            self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
