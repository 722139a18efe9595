"""The model's inventory of tensors: every parameter and buffer once, with every name it has
(tied weights have several), and putting a tensor into all of its places at once."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from notebook_launcher.big_modeling.sizes import nbytes, target_dtype


@dataclass
class Slot:
    """One place a tensor sits in the model: ``module.<attr>`` (a parameter or a buffer)."""

    name: str
    module: torch.nn.Module
    attr: str
    is_parameter: bool
    persistent: bool

    def get(self) -> torch.Tensor | None:
        table = self.module._parameters if self.is_parameter else self.module._buffers
        return table[self.attr]

    def set(self, tensor: torch.Tensor | None) -> None:
        table = self.module._parameters if self.is_parameter else self.module._buffers
        table[self.attr] = tensor  # type: ignore[assignment]


@dataclass
class Weight:
    """One tensor of the model with every name it has (tied weights have several)."""

    name: str  # the first name, under which it is stored and offloaded
    tensor: torch.Tensor
    slots: list[Slot] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    def size(self, dtype: torch.dtype | None = None) -> int:
        return nbytes(self.tensor.shape, target_dtype(self.tensor.dtype, dtype))

    @property
    def is_parameter(self) -> bool:
        return self.slots[0].is_parameter

    @property
    def persistent(self) -> bool:
        return any(s.persistent for s in self.slots)


def model_weights(model: torch.nn.Module) -> dict[str, Weight]:
    """Every tensor of the model once, by first name; tied weights gather all their names."""
    by_identity: dict[int, Weight] = {}
    ordered: dict[str, Weight] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind, tensors in (("p", module._parameters), ("b", module._buffers)):
            for attr, tensor in tensors.items():
                if tensor is None:
                    continue
                name = f"{prefix}.{attr}" if prefix else attr
                persistent = kind == "p" or attr not in module._non_persistent_buffers_set
                slot = Slot(name, module, attr, kind == "p", persistent)
                weight = by_identity.get(id(tensor))
                if weight is None:
                    weight = by_identity[id(tensor)] = ordered[name] = Weight(name, tensor)
                weight.slots.append(slot)
    return ordered


def alias_table(weights: dict[str, Weight]) -> dict[str, str]:
    """Any name of a tensor -> its first name."""
    return {slot.name: weight.name for weight in weights.values() for slot in weight.slots}


def owns(key: str, name: str) -> bool:
    """Whether the device-map entry ``key`` covers the tensor or module ``name``."""
    return key == "" or name == key or name.startswith(key + ".")


def current(weight: Weight) -> torch.Tensor:
    """The tensor in the weight's first slot now."""
    tensor = weight.slots[0].get()
    if tensor is None:  # pragma: no cover - model_weights lists only slots holding a tensor
        raise RuntimeError(f"{weight.name!r} was set to None after the model was dispatched")
    return tensor


def install(weight: Weight, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in every slot of ``weight``: one Parameter object, so ties hold."""
    present = weight.slots[0].get()
    value: torch.Tensor
    if weight.is_parameter:
        requires_grad = bool(
            present is not None and present.requires_grad and tensor.is_floating_point()
        )
        value = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    else:
        value = tensor
    for slot in weight.slots:
        slot.set(value)
    weight.tensor = value


def to_meta(weight: Weight) -> None:
    """Leave only the shape behind: the data lives in an offload store."""
    tensor = current(weight)
    if tensor.device.type != "meta":
        install(weight, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
