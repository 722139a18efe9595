"""What running a model (not training it) takes beside its weights: the KV cache that
generation keeps, and the activations of one forward, which inference frees as it goes."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _config_value(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def kv_cache_bytes(model: torch.nn.Module, dtype: torch.dtype, batch: int, length: int) -> int:
    """2 (keys and values) x layers x batch x sequence x kv_heads x head_dim x itemsize.

    ``kv_heads`` is the config's ``num_key_value_heads`` where it has one (grouped-query
    attention keeps fewer heads of keys and values than of queries), else the number of
    attention heads. Models that do not generate (an encoder) keep no cache: 0.
    """
    can_generate = getattr(model, "can_generate", None)
    config = getattr(model, "config", None)
    if config is None or not callable(can_generate) or not can_generate():
        return 0
    config = getattr(config, "get_text_config", lambda: config)()
    layers = _config_value(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _config_value(config, "num_attention_heads", "n_head")
    hidden = _config_value(config, "hidden_size", "n_embd", "d_model")
    if layers is None or heads is None:
        return 0
    kv_heads = _config_value(config, "num_key_value_heads") or heads
    head_dim = _config_value(config, "head_dim") or (hidden // heads if hidden else 0)
    return 2 * layers * batch * length * kv_heads * head_dim * dtype.itemsize


class _LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the bytes of tensors alive while a forward runs on the meta device, and their peak."""

    def __init__(self, ignore: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ignore = ignore  # storages of the weights and inputs
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.ignore or key in self._seen:
            return
        size = storage.nbytes()
        self._seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size


def inference_activations(
    model: torch.nn.Module,
    meta_weights: Mapping[str, torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> int:
    """The peak bytes of tensors one forward holds at once, without autograd and without
    a cache (counted apart), its outputs included: traced on the meta device."""
    from torch.func import functional_call

    ignore = {t.untyped_storage()._cdata for t in meta_weights.values()}
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            ignore.add(value.untyped_storage()._cdata)
    counter = _LiveBytes(ignore)
    with torch.no_grad(), counter:
        output = functional_call(model, dict(meta_weights), args, kwargs, strict=False)
        del output
    return counter.peak
