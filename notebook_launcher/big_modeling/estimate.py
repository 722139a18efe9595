"""``estimate_memory``: what training a model takes per rank, or running it for inference,
before building it for real.

Parameters, gradients and AdamW's two moments are counted from the model's shapes; the
activations of one forward (with the loss) are *traced*: the model runs on the ``meta``
device (shapes only, no memory, no compute) while a saved-tensors hook adds up what
autograd keeps for the backward pass. With LoRA, only the adapters train; with several
ranks, DDP keeps everything on each rank, FSDP2 splits it. For inference
(``training=False``): the weights, the KV cache that generation keeps, and the peak of one
forward's activations without autograd.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from notebook_launcher.big_modeling.empty import init_empty_weights
from notebook_launcher.big_modeling.inference_memory import inference_activations, kv_cache_bytes
from notebook_launcher.big_modeling.inventory import Weight, model_weights
from notebook_launcher.big_modeling.sizes import format_bytes, resolve_dtype
from notebook_launcher.errors import BigModelError


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs to train a model with AdamW (all figures per rank), or, with
    ``training=False``, to run it for inference (no gradients, no optimizer state).

    Attributes:
        model: the model's class name.
        dtype: the dtype of the weights (``"float32"``, ``"bfloat16"``, ...).
        batch_size: sequences per rank in one step.
        sequence_length: tokens per sequence.
        world_size: ranks training together.
        sharding: ``"ddp"`` (each rank holds everything) or ``"fsdp"`` (FSDP2's
            ``fully_shard``: weights, gradients and optimizer state split over the ranks).
        lora_rank: the LoRA rank, or None for full fine-tuning.
        lora_target_modules: the module names LoRA adapts (None without LoRA).
        num_parameters: parameters of the model (tied weights once), adapters excluded.
        trainable_parameters: parameters that get gradients: all of them, or LoRA's adapters.
        parameters: bytes of weights this rank holds (base model, plus adapters with LoRA;
            adapters in float32, as peft keeps them by default).
        gradients: bytes of gradients this rank holds (trainable parameters only).
        optimizer_state: bytes of AdamW's ``exp_avg`` and ``exp_avg_sq`` this rank holds
            (two per trainable parameter, in its dtype, as ``torch.optim.AdamW`` keeps them).
        activations: bytes autograd keeps from one forward for the backward pass, loss
            included, for ``batch_size`` x ``sequence_length`` tokens on this rank.
        communication: bytes of collective buffers: DDP's gradient buckets (one copy of
            the gradients), or for FSDP2 two layers gathered whole (the one computing and
            the one prefetched), with their gradients.
        training: whether these are the figures of training (else of inference).
        kv_cache_bytes: bytes of the KV cache for ``batch_size`` sequences of
            ``sequence_length`` tokens: 2 x layers x batch x sequence x kv_heads x head_dim
            x itemsize (kv_heads from grouped-query attention where the model uses it);
            0 when training, and for models that do not generate.
        activations_method: ``"traced"`` (measured on the meta device), ``"formula"``
            (a transformer's per-layer estimate, when tracing failed) or ``"none"`` (a
            plain module given without an example input).
    """

    model: str
    dtype: str
    batch_size: int
    sequence_length: int
    world_size: int
    sharding: str
    lora_rank: int | None
    lora_target_modules: tuple[str, ...] | None
    num_parameters: int
    trainable_parameters: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    communication: int
    activations_method: str
    training: bool = True
    kv_cache_bytes: int = 0

    @property
    def total(self) -> int:
        """Everything above added: the peak of one training step (or one forward with its
        cache, for inference) on one rank, roughly."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer_state
            + self.activations
            + self.communication
            + self.kv_cache_bytes
        )

    @property
    def inference(self) -> int:
        """Weights only: what ``load_checkpoint_and_dispatch`` needs to hold the model."""
        return self.parameters

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["total"] = self.total
        return data

    def _rows(self) -> list[tuple[str, int]]:
        if not self.training:
            return [
                ("weights", self.parameters),
                ("KV cache", self.kv_cache_bytes),
                (f"activations ({self.activations_method})", self.activations),
                ("total", self.total),
            ]
        return [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state (AdamW)", self.optimizer_state),
            (f"activations ({self.activations_method})", self.activations),
            ("communication buffers", self.communication),
            ("total per rank", self.total),
        ]

    def _title(self) -> str:
        if not self.training:
            return (
                f"{self.model}: {self.num_parameters:,} parameters in {self.dtype}, inference, "
                f"batch {self.batch_size} x {self.sequence_length} tokens"
            )
        how = f"LoRA rank {self.lora_rank}" if self.lora_rank else "full fine-tuning"
        ranks = f", {self.world_size} ranks ({self.sharding})" if self.world_size > 1 else ""
        return (
            f"{self.model}: {self.num_parameters:,} parameters in {self.dtype}, {how} "
            f"({self.trainable_parameters:,} trainable), batch {self.batch_size} x "
            f"{self.sequence_length} tokens{ranks}"
        )

    def __str__(self) -> str:
        lines = [self._title()]
        lines += [f"  {label:<28} {format_bytes(value):>12}" for label, value in self._rows()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        rows = "".join(
            f"<tr><td>{html.escape(label)}</td><td style='text-align:right'>{html.escape(format_bytes(v))}</td></tr>"
            for label, v in self._rows()
        )
        return (
            f"<div class='tex2jax_ignore mathjax_ignore'><p>{html.escape(self._title())}</p>"
            f"<table>{rows}</table></div>"
        )


def estimate_memory(
    model_or_config: Any,
    dtype: str | torch.dtype | None = None,
    batch_size: int = 1,
    sequence_length: int = 512,
    *,
    lora_rank: int | None = None,
    lora_target_modules: Sequence[str] | str | None = None,
    world_size: int = 1,
    sharding: str = "ddp",
    example_input: Any = None,
    training: bool = True,
) -> MemoryEstimate:
    """Per-rank memory to train ``model_or_config`` with AdamW, activations included; with
    ``training=False``, the memory to run it: weights, KV cache and one forward's activations.

    ``model_or_config`` is a model (built for real or with :func:`init_empty_weights`), a
    transformers config, a config dict, or the path of a ``config.json``: it is built on
    the meta device, so a 70B configuration costs nothing. ``dtype`` is the weights' dtype
    (default: the model's, or the config's ``torch_dtype``). With ``lora_rank``, adapters of
    that rank on ``lora_target_modules`` (module names such as ``["q_proj", "v_proj"]``,
    or ``"all-linear"``, the default: every linear layer but the output head) are the only
    trainable parameters. ``world_size`` and ``sharding`` (``"ddp"`` or ``"fsdp"``) give
    the figures of one rank; ``batch_size`` is per rank. A model that is not a transformers
    model needs ``example_input`` (what its forward takes) for its activations.

    With ``training=False`` there are no gradients, optimizer state or collective buffers;
    ``kv_cache_bytes`` is the cache of ``batch_size`` sequences of ``sequence_length``
    tokens (prompt and generated tokens together), and the activations are the peak one
    forward over the whole sequence holds at once (its logits included), traced on the
    meta device without autograd.

    Raises:
        BigModelError: a bad size, dtype, sharding or target module, or a config that
            transformers cannot build.
    """
    for what, value in (
        ("batch_size", batch_size),
        ("sequence_length", sequence_length),
        ("world_size", world_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BigModelError(
                f"estimate_memory({what}={value!r}): pass a whole number of at least 1."
            )
    if sharding not in ("ddp", "fsdp"):
        raise BigModelError(f"estimate_memory(sharding={sharding!r}): pass 'ddp' or 'fsdp'.")
    if lora_rank is not None and (
        isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1
    ):
        raise BigModelError(
            f"estimate_memory(lora_rank={lora_rank!r}): pass a whole number of at least 1, or None."
        )
    model = _as_model(model_or_config)
    weights = model_weights(model)
    params = {n: w for n, w in weights.items() if w.is_parameter}
    chosen = resolve_dtype(dtype) or _model_dtype(model, params)
    size = chosen.itemsize
    num_parameters = sum(w.tensor.numel() for w in params.values())
    targets = _lora_targets(model, lora_target_modules) if lora_rank else {}
    if lora_rank:
        adapter_dtype = torch.float32 if size < 4 else chosen
        trainable = sum(lora_rank * (shape[0] + shape[1]) for shape in targets.values())
        trainable_bytes = trainable * adapter_dtype.itemsize
        weight_bytes = num_parameters * size + trainable_bytes
    else:
        trainable = sum(w.tensor.numel() for w in params.values() if w.tensor.requires_grad)
        trainable_bytes = trainable * size
        weight_bytes = num_parameters * size
    if not training:
        activations, method = _inference_activations(
            model, chosen, batch_size, sequence_length, example_input
        )
        return MemoryEstimate(
            model=type(model).__name__,
            dtype=str(chosen).replace("torch.", ""),
            batch_size=batch_size,
            sequence_length=sequence_length,
            world_size=1,
            sharding=sharding,
            lora_rank=lora_rank,
            lora_target_modules=tuple(sorted({n.rsplit(".", 1)[-1] for n in targets}))
            if lora_rank
            else None,
            num_parameters=num_parameters,
            trainable_parameters=0,
            parameters=weight_bytes,
            gradients=0,
            optimizer_state=0,
            activations=activations,
            communication=0,
            activations_method=method,
            training=False,
            kv_cache_bytes=kv_cache_bytes(model, chosen, batch_size, sequence_length),
        )
    gradients = trainable_bytes
    optimizer = 2 * trainable_bytes
    activations, method = _activations(
        model, params, chosen, batch_size, sequence_length, targets, lora_rank, example_input
    )
    layer = _largest_layer_bytes(model, size)
    if world_size > 1 and sharding == "fsdp":

        def split(count: int) -> int:
            return -(-count // world_size)  # ceil division

        weight_bytes, gradients, optimizer = split(weight_bytes), split(gradients), split(optimizer)
        communication = 2 * layer + (2 * layer if not lora_rank else 0)
    elif world_size > 1:
        communication = gradients
    else:
        communication = 0
    return MemoryEstimate(
        model=type(model).__name__,
        dtype=str(chosen).replace("torch.", ""),
        batch_size=batch_size,
        sequence_length=sequence_length,
        world_size=world_size,
        sharding=sharding,
        lora_rank=lora_rank,
        lora_target_modules=tuple(sorted({n.rsplit(".", 1)[-1] for n in targets}))
        if lora_rank
        else None,
        num_parameters=num_parameters,
        trainable_parameters=trainable,
        parameters=weight_bytes,
        gradients=gradients,
        optimizer_state=optimizer,
        activations=activations,
        communication=communication,
        activations_method=method,
    )


def _as_model(model_or_config: Any) -> torch.nn.Module:
    if isinstance(model_or_config, torch.nn.Module):
        return model_or_config
    config = model_or_config
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise BigModelError(
                f"estimate_memory({path!r}): cannot read a JSON config there ({e})."
            ) from e
    try:
        import transformers
    except ImportError as e:
        raise BigModelError(
            "estimate_memory() of a config needs transformers to build the model: pip install "
            "transformers, or pass a model built with init_empty_weights()."
        ) from e
    if isinstance(config, Mapping):
        values = dict(config)
        kind = values.pop("model_type", None)
        if not kind:
            raise BigModelError(
                "estimate_memory(): the config has no 'model_type' (such as 'llama' or 'gpt2'); "
                "pass the config.json a model was saved with."
            )
        try:
            config = transformers.AutoConfig.for_model(kind, **values)
        except ValueError as e:
            raise BigModelError(
                f"estimate_memory(): transformers does not know model_type {kind!r} ({e})."
            ) from e
    with init_empty_weights():
        for auto in (
            transformers.AutoModelForCausalLM,
            transformers.AutoModelForMaskedLM,
            transformers.AutoModel,
        ):
            try:
                built: torch.nn.Module = cast(Any, auto).from_config(config)
                return built
            except ValueError:
                continue
    raise BigModelError(
        f"estimate_memory(): transformers has no model class for {type(config).__name__}."
    )


def _model_dtype(model: torch.nn.Module, params: Mapping[str, Weight]) -> torch.dtype:
    config = getattr(model, "config", None)
    config_dtype = (
        getattr(config, "dtype", None)
        if hasattr(config, "dtype")
        else getattr(config, "torch_dtype", None)
    )
    if isinstance(config_dtype, torch.dtype) and config_dtype.is_floating_point:
        return config_dtype
    for weight in params.values():
        if weight.tensor.is_floating_point():
            return weight.tensor.dtype
    return torch.float32


def _lora_targets(
    model: torch.nn.Module, targets: Sequence[str] | str | None
) -> dict[str, tuple[int, int]]:
    """Module name -> (rows, columns) of the weight an adapter is added to."""
    output = getattr(model, "get_output_embeddings", lambda: None)()
    found: dict[str, tuple[int, int]] = {}
    every_linear = targets is None or targets == "all-linear"
    wanted = (
        [] if every_linear else ([targets] if isinstance(targets, str) else list(targets or []))
    )
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or module is output:
            continue
        linear = isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        if (every_linear and linear) or any(
            name == t or name.endswith("." + t) or re.fullmatch(t, name) for t in wanted
        ):
            found[name] = (int(weight.shape[0]), int(weight.shape[1]))
    if not found:
        names = sorted(
            {
                n.rsplit(".", 1)[-1]
                for n, m in model.named_modules()
                if isinstance(getattr(m, "weight", None), torch.Tensor)
            }
        )
        raise BigModelError(
            f"estimate_memory(lora_target_modules={targets!r}) matches no module of "
            f"{type(model).__name__}; its modules with weights are named {names[:12]}."
        )
    return found


def _largest_layer_bytes(model: torch.nn.Module, size: int) -> int:
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    best = 0
    for module in model.modules():
        if type(module).__name__ in no_split:
            best = max(best, sum(p.numel() for p in module.parameters()) * size)
    if not best:
        best = max(
            (sum(p.numel() for p in m.parameters(recurse=False)) * size for m in model.modules()),
            default=0,
        )
    return best


def _activations(
    model: torch.nn.Module,
    params: Mapping[str, Any],
    dtype: torch.dtype,
    batch: int,
    length: int,
    targets: Mapping[str, tuple[int, int]],
    lora_rank: int | None,
    example_input: Any,
) -> tuple[int, str]:
    try:
        traced = _trace(model, params, dtype, batch, length, targets, example_input)
    except Exception:  # any op without a meta kernel: fall back to the formula
        traced = None
    if traced is None:
        formula = _formula(model, dtype, batch, length)
        if formula is None:
            return 0, "none"
        return formula, "formula"
    extra = (
        sum(batch * length * lora_rank * 4 for _ in targets) if lora_rank else 0
    )  # x @ A, kept in float32
    return traced + extra, "traced"


def _inference_activations(
    model: torch.nn.Module, dtype: torch.dtype, batch: int, length: int, example_input: Any
) -> tuple[int, str]:
    meta: dict[str, torch.Tensor] = {}
    for weight in model_weights(model).values():
        tensor = weight.tensor
        kind = dtype if tensor.is_floating_point() else tensor.dtype
        value = torch.empty(tensor.shape, dtype=kind, device="meta")
        for slot_name in weight.names:
            meta[slot_name] = value
    kwargs: dict[str, Any] = {}
    if example_input is not None:
        args = example_input if isinstance(example_input, tuple) else (example_input,)
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    elif hasattr(model, "config") and hasattr(model, "main_input_name"):
        ids = torch.zeros(batch, length, dtype=torch.long, device="meta")
        # No cache (counted apart), and the causal mask given whole: transformers would
        # otherwise inspect the position ids or the mask's values, which the meta device has not.
        mask = torch.ones(batch, 1, length, length, dtype=torch.bool, device="meta")
        args, kwargs = (), {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    else:
        return 0, "none"
    try:
        return inference_activations(model, meta, args, kwargs), "traced"
    except Exception:  # any op without a meta kernel: fall back to the formula
        formula = _inference_formula(model, dtype, batch, length)
        return (formula, "formula") if formula is not None else (0, "none")


def _config_get(config: Any, *names: str) -> Any:
    """The first of ``names`` the config sets (to something true), else None."""
    return next((getattr(config, n) for n in names if getattr(config, n, None)), None)


def _inference_formula(
    model: torch.nn.Module, dtype: torch.dtype, batch: int, length: int
) -> int | None:
    """One layer's peak (its input and output, the attention scores, the MLP's widest
    tensor), plus the logits in float32."""
    config = getattr(model, "config", None)

    def get(*names: str) -> Any:
        return _config_get(config, *names)

    hidden = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head")
    if not (hidden and heads):
        return None
    wide = get("intermediate_size", "n_inner") or 4 * hidden
    vocab = get("vocab_size") or 0
    per_layer = batch * (2 * length * hidden + heads * length * length + 2 * length * wide)
    return int(per_layer * dtype.itemsize + batch * length * vocab * 4)


def _trace(
    model: torch.nn.Module,
    params: Mapping[str, Any],
    dtype: torch.dtype,
    batch: int,
    length: int,
    targets: Mapping[str, tuple[int, int]],
    example_input: Any,
) -> int | None:
    from torch.func import functional_call

    lora = bool(targets)
    meta: dict[str, torch.Tensor] = {}
    weight_storages: set[int] = set()
    for name, weight in model_weights(model).items():
        tensor = weight.tensor
        kind = dtype if tensor.is_floating_point() else tensor.dtype
        trains = any(name.startswith(t + ".") for t in targets) if lora else tensor.requires_grad
        value = torch.empty(tensor.shape, dtype=kind, device="meta").requires_grad_(
            weight.is_parameter and trains and kind.is_floating_point
        )
        weight_storages.add(value.untyped_storage()._cdata)
        for slot_name in weight.names:
            meta[slot_name] = value
    if example_input is not None:
        args, kwargs = (example_input if isinstance(example_input, tuple) else (example_input,)), {}
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    elif hasattr(model, "config") and hasattr(model, "main_input_name"):
        ids = torch.zeros(batch, length, dtype=torch.long, device="meta")
        args, kwargs = (), {"input_ids": ids, "labels": ids}
    else:
        return None
    kept: dict[int, int] = {}
    hold: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in weight_storages:
            kept[storage._cdata] = storage.nbytes()
            hold.append(tensor)  # keeps the storage alive, so its id is not reused
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = functional_call(model, meta, args, kwargs, tie_weights=False, strict=False)
    results: list[Any] = [
        getattr(output, "loss", None),
        getattr(output, "logits", output if isinstance(output, torch.Tensor) else None),
    ]
    outputs = 0
    for tensor in results:
        if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in kept:
            outputs += tensor.untyped_storage().nbytes()
    return sum(kept.values()) + outputs


def _formula(model: torch.nn.Module, dtype: torch.dtype, batch: int, length: int) -> int | None:
    """Korthikanti et al. (2022): s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit, plus logits."""
    config = getattr(model, "config", None)

    def get(*names: str) -> Any:
        return _config_get(config, *names)

    hidden = get("hidden_size", "n_embd", "d_model")
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    heads = get("num_attention_heads", "n_head")
    vocab = get("vocab_size")
    if not (hidden and layers and heads):
        return None
    scale = dtype.itemsize / 2
    per_layer = length * batch * hidden * (34 + 5 * heads * length / hidden) * scale
    return int(layers * per_layer + batch * length * (vocab or 0) * 4 * 2)
