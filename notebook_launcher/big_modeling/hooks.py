"""The hook layer of a dispatched model: each block's forward is wrapped so that its inputs
move to the device that runs it, and its borrowed weights sit in their slots for the length
of the forward and leave them after, whatever ends it (a return, an error, or the stop
button's KeyboardInterrupt, which torch's own forward hooks do not see). The model's own
forward brings its outputs back to the device of its inputs, with synchronous copies.

The weights themselves come from the :class:`WeightFetcher`; this layer only puts them in
their slots and decides which block comes next."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from notebook_launcher.big_modeling.fetcher import Fetched, WeightFetcher
from notebook_launcher.big_modeling.inventory import Slot
from notebook_launcher.errors import BigModelError

HOOKS_ATTRIBUTE = "_big_model_hooks"
GUARD_ATTRIBUTE = "_big_model_meta_guard"


@dataclass
class Block:
    """A module whose forward borrows weights (or only moves its inputs), and where it runs."""

    key: int
    name: str
    module: torch.nn.Module
    device: torch.device
    slots: dict[str, list[Slot]] = field(default_factory=dict)  # weight name -> its slots here
    is_parameter: dict[str, bool] = field(default_factory=dict)


@dataclass(eq=False)  # compared by identity: one entry per forward of a block
class _Lent:
    fetched: Fetched
    swapped: list[tuple[Slot, torch.Tensor | None]]


def move(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it on ``device`` (a synchronous copy where needed)."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, (list, tuple)):
        moved = [move(v, device) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    if isinstance(value, dict):
        if type(value) is dict:
            return {k: move(v, device) for k, v in value.items()}
        for key in list(value.keys()):  # ModelOutput and other mappings: changed in place
            value[key] = move(value[key], device)
        return value
    return value


def first_device(value: Any) -> torch.device | None:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, (list, tuple)):
        values: Any = value
    elif isinstance(value, dict):
        values = value.values()
    else:
        return None
    for item in values:
        found = first_device(item)
        if found is not None:
            return found
    return None


class OffloadHooks:
    """The wrapped forwards of one dispatched model."""

    def __init__(
        self,
        model: torch.nn.Module,
        main: torch.device,
        blocks: list[Block],
        fetcher: WeightFetcher,
        skip_keys: frozenset[str] = frozenset(),
    ) -> None:
        self.main = main
        self.fetcher = fetcher
        self.skip_keys = skip_keys
        self._wrapped: list[tuple[torch.nn.Module, Any]] = []
        self._lent: dict[int, list[_Lent]] = {}
        self._depth = 0  # forwards of the model under way (generate() nests none, but users may)
        self._last: int | None = None
        borrowing = [b.key for b in blocks if b.slots]
        # First guess at the order: the map's; corrected by what runs (a block used twice,
        # or out of order). It never wraps from the last block to the first: nothing is
        # held between forwards.
        self._next = dict(zip(borrowing, borrowing[1:], strict=False))
        self._first: int | None = borrowing[0] if borrowing else None
        for block in blocks:
            self._wrap(block.module, functools.partial(self._run_block, block))
        self._wrap(model, self._run_model)
        # Collecting the model ends the thread and closes the folder: the fetcher holds
        # nothing of the model, so this does not keep it alive.
        self._finalizer = weakref.finalize(model, fetcher.close)

    def _wrap(self, module: torch.nn.Module, run: Callable[..., Any]) -> None:
        own = module.__dict__.get("forward")  # a forward set on the instance (another library's)
        inner = module.forward

        @functools.wraps(inner)  # generate() reads the forward's signature
        def forward(*args: Any, **kwargs: Any) -> Any:
            return run(inner, *args, **kwargs)

        module.forward = forward
        self._wrapped.append((module, own))

    def _inputs_to(
        self, device: torch.device, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        moved = {k: v if k in self.skip_keys else move(v, device) for k, v in kwargs.items()}
        return move(args, device), moved

    def _run_model(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        device = first_device((args, kwargs))
        args, kwargs = self._inputs_to(self.main, args, kwargs)
        self._depth += 1
        try:
            if self._depth == 1:
                self._last = None
                if self._first is not None:
                    # The first offloaded block is read while the blocks before it compute.
                    self.fetcher.prefetch(self._first)
            output = inner(*args, **kwargs)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.fetcher.drop_pending()
        return output if device is None else move(output, device)

    def _run_block(self, block: Block, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._inputs_to(block.device, args, kwargs)
        if not block.slots:
            return inner(*args, **kwargs)
        lent = self._lend(block)
        try:
            return inner(*args, **kwargs)
        finally:
            self._give_back(block, lent)
            if self._depth == 0:  # the block was called on its own, not by the model
                self.fetcher.drop_pending()

    def _lend(self, block: Block) -> _Lent:
        if self._last is None:
            self._first = block.key
        elif self._last != block.key:
            self._next[self._last] = block.key
        self._last = block.key
        lent = _Lent(self.fetcher.take(block.key), [])
        try:
            if lent.fetched.event is not None:
                stream = torch.cuda.current_stream(block.device)
                stream.wait_event(lent.fetched.event)
                for tensor in lent.fetched.tensors.values():
                    tensor.record_stream(stream)
            for name, slots in block.slots.items():
                tensor = lent.fetched.tensors[name]
                value = (
                    torch.nn.Parameter(tensor, requires_grad=False)
                    if block.is_parameter[name]
                    else tensor
                )
                for slot in slots:
                    lent.swapped.append((slot, slot.get()))
                    slot.set(value)
        except BaseException:
            self._restore(lent)
            raise
        self._lent.setdefault(block.key, []).append(lent)
        following = self._next.get(block.key)
        if following is not None and following != block.key:
            self.fetcher.prefetch(following)
        return lent

    def _give_back(self, block: Block, lent: _Lent) -> None:
        stack = self._lent.get(block.key, [])
        if lent in stack:
            stack.remove(lent)
        if not stack:
            self._lent.pop(block.key, None)
        self._restore(lent)

    def _restore(self, lent: _Lent) -> None:
        for slot, previous in reversed(lent.swapped):
            slot.set(previous)
        lent.swapped.clear()
        self.fetcher.release(lent.fetched)

    def blocks_in_flight(self) -> tuple[int, int]:
        """(blocks whose weights are lent now, blocks fetched ahead and not lent yet)."""
        return sum(len(s) for s in self._lent.values()), self.fetcher.pending_count()

    def remove(self) -> None:
        for module, own in reversed(self._wrapped):
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own
        self._wrapped.clear()
        self._finalizer()  # closes the fetcher now, once


def attach_hooks(
    model: torch.nn.Module,
    main: torch.device,
    blocks: list[Block] | None = None,
    fetcher: WeightFetcher | None = None,
    skip_keys: frozenset[str] = frozenset(),
) -> OffloadHooks:
    """Wrap ``model`` (replacing hooks attached before) and remember the hooks on it."""
    detach_hooks(model)
    hooks = OffloadHooks(
        model, main, blocks or [], fetcher or WeightFetcher({}, {}, None), skip_keys
    )
    setattr(model, HOOKS_ATTRIBUTE, hooks)
    return hooks


def attached(model: torch.nn.Module) -> OffloadHooks | None:
    hooks = model.__dict__.get(HOOKS_ATTRIBUTE)
    return hooks if isinstance(hooks, OffloadHooks) else None


def detach_hooks(model: torch.nn.Module) -> None:
    hooks = attached(model)
    if hooks is not None:
        hooks.remove()
        del model.__dict__[HOOKS_ATTRIBUTE]
    _unguard(model)


def guard_meta(model: torch.nn.Module, slots: list[Slot]) -> None:
    """Make a forward of ``model`` fail with a clear message while any of ``slots`` holds a
    tensor on the meta device (torch's own error names neither the weight nor the cause).
    The guard goes away by itself once they all hold data, or when the model is dispatched."""
    if not slots:
        return
    _unguard(model)
    own = model.__dict__.get("forward")
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        empty = [s.name for s in slots if (t := s.get()) is not None and t.device.type == "meta"]
        if empty:
            shown = ", ".join(repr(n) for n in empty[:3]) + (
                f" and {len(empty) - 3} more" if len(empty) > 3 else ""
            )
            raise BigModelError(
                f"{type(model).__name__} cannot run: {shown} {'is' if len(empty) == 1 else 'are'} "
                "on the meta device (no data): remove_hooks(model) leaves the weights offloaded "
                "to disk there. Load them again (load_checkpoint_in_model(model, checkpoint)), or "
                "dispatch the model again; next time, remove_hooks(model, restore=True) reads "
                "them back into CPU memory."
            )
        _unguard(model)
        return inner(*args, **kwargs)

    model.forward = forward
    model.__dict__[GUARD_ATTRIBUTE] = (own,)


def _unguard(model: torch.nn.Module) -> None:
    guard = model.__dict__.pop(GUARD_ATTRIBUTE, None)
    if guard is None:
        return
    own = guard[0]
    if own is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = own
