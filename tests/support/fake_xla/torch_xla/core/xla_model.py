"""torch_xla.core.xla_model, faked over CPU devices and a gloo interconnect."""

from __future__ import annotations

import io
from typing import Any, Callable

import torch

from torch_xla import _fake, runtime

REDUCE_SUM = "sum"
REDUCE_MAX = "max"
REDUCE_MIN = "min"


def xla_device(n: int | None = None, devkind: str | None = None) -> torch.device:
    return _fake.device()


def get_xla_supported_devices(max_devices: int | None = None) -> list[str]:
    return [f"xla:{i}" for i in range(_fake.devices_per_process())]


def set_replication(device: torch.device, devices: list[str]) -> None:
    pass


def get_ordinal() -> int:
    return runtime.global_ordinal()


def get_local_ordinal() -> int:
    return runtime.local_ordinal()


def xrt_world_size() -> int:
    return runtime.world_size()


def is_master_ordinal(local: bool = True) -> bool:
    return (get_local_ordinal() if local else get_ordinal()) == 0


def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    _fake.calls["mark_step"] += 1


def wait_device_ops(devices: list[str] = []) -> None:  # noqa: B006 (the real signature)
    pass


def all_reduce(
    reduce_type: str, inputs: Any, scale: float = 1.0, groups: Any = None, pin_layout: bool = True
) -> Any:
    _fake.calls["all_reduce"] += 1
    _fake.calls[f"all_reduce_{reduce_type}"] += 1
    if isinstance(inputs, torch.Tensor):
        result = inputs.clone()
        _fake.all_reduce(reduce_type, [result])
        return result * scale if scale != 1.0 else result
    _fake.all_reduce(reduce_type, list(inputs))
    if scale != 1.0:
        for tensor in inputs:
            tensor.mul_(scale)
    return inputs


def all_gather(
    value: torch.Tensor,
    dim: int = 0,
    groups: Any = None,
    output: Any = None,
    pin_layout: bool = True,
    channel_id: Any = None,
    use_global_device_ids: Any = None,
) -> torch.Tensor:
    _fake.calls["all_gather"] += 1
    return torch.cat(_fake.all_gather(value), dim=dim)


def reduce_gradients(
    optimizer: torch.optim.Optimizer, groups: Any = None, pin_layout: bool = True
) -> None:
    _fake.calls["reduce_gradients"] += 1
    count = runtime.world_size()
    if count > 1:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        all_reduce(REDUCE_SUM, grads, scale=1.0 / count)


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    barrier: bool = False,
    optimizer_args: dict[str, Any] = {},  # noqa: B006 (the real signature)
    groups: Any = None,
    pin_layout: bool = True,
) -> Any:
    _fake.calls["optimizer_step"] += 1
    reduce_gradients(optimizer, groups=groups, pin_layout=pin_layout)
    return optimizer.step(**optimizer_args)


def rendezvous(tag: str, payload: bytes = b"", replicas: list[int] = []) -> list[bytes]:  # noqa: B006
    _fake.calls["rendezvous"] += 1
    return _fake.rendezvous(tag, payload)


def mesh_reduce(tag: str, data: Any, reduce_fn: Callable[[list[Any]], Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(data, buffer)
    # As torch_xla 2.9: torch.load's default, weights_only=True since torch 2.6.
    gathered = [torch.load(io.BytesIO(d)) for d in rendezvous(tag, buffer.getvalue())]
    return reduce_fn(gathered)


def save(
    data: Any, file_or_path: Any, master_only: bool = True, global_master: bool = False
) -> None:
    _fake.calls["save"] += 1
    if not master_only or is_master_ordinal(local=not global_master):
        torch.save(data, file_or_path)
