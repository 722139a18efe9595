"""The fake's hardware: CPU devices, and a gloo group between replicas as the interconnect."""

from __future__ import annotations

import collections
import datetime
import os
import re
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

calls: collections.Counter[str] = collections.Counter()  # what the code under test used
runtime_started = False  # set by the first use of a device, inherited by forks like the real one
_local = threading.local()  # per replica thread: its ordinal and group
_TIMEOUT = datetime.timedelta(seconds=120)


def chips() -> int:
    return int(os.environ.get("FAKE_TPU_CHIPS", "1"))


def devices_per_process() -> int:
    kind = device_type()
    if kind == "CPU":
        return int(os.environ.get("CPU_NUM_DEVICES", "1"))
    match = re.match(r"^v(\d)", os.environ.get("TPU_ACCELERATOR_TYPE", ""))
    return 2 if match and int(match.group(1)) <= 3 else 1


def device_type() -> str | None:
    value = os.environ.get("PJRT_DEVICE")
    return value.split("_")[0] if value else value


def start_runtime() -> None:
    global runtime_started
    if device_type() is None:
        raise RuntimeError("fake torch_xla: PJRT_DEVICE is not set")
    runtime_started = True


def device() -> torch.device:
    start_runtime()
    calls["device"] += 1
    return torch.device("cpu")


_process_ordinal = 0  # a thread torch_xla did not start (a loader's) uses the process's device


def ordinal() -> int:
    return getattr(_local, "ordinal", _process_ordinal)


def world_size() -> int:
    return int(os.environ.get("FAKE_XLA_WORLD_SIZE", "1"))


def set_replica(ordinal_: int, first_of_process: bool = True) -> None:
    global _process_ordinal
    if first_of_process:
        _process_ordinal = ordinal_
    _local.ordinal = ordinal_
    _local.group = None
    _local.generation = collections.Counter()


def _store() -> dist.Store:
    host, port = os.environ["FAKE_XLA_STORE"].rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=_TIMEOUT)


def wait_for_all_processes(count: int) -> None:
    """As the real runtime's start, which connects every process of the host before any runs."""
    store = _store()
    store.add("fake-xla-started", 1)
    while int(store.add("fake-xla-started", 0)) < count:
        time.sleep(0.01)


def group() -> Any:
    found = getattr(_local, "group", None)
    if found is None:
        found = dist.ProcessGroupGloo(
            dist.PrefixStore("fake-xla-ici", _store()), ordinal(), world_size(), _TIMEOUT
        )
        _local.group = found
    return found


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(kind: str, tensors: list[torch.Tensor]) -> None:
    if world_size() > 1:
        options = dist.AllreduceOptions()
        options.reduceOp = _OPS[kind]
        for tensor in tensors:  # gloo reads a list as one tensor per local device
            group().allreduce([tensor], options).wait()


def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    if world_size() == 1:
        return [tensor]
    outputs = [[torch.empty_like(tensor) for _ in range(world_size())]]
    group().allgather(outputs, [tensor.contiguous()]).wait()
    return outputs[0]


def rendezvous(tag: str, payload: bytes) -> list[bytes]:
    if world_size() == 1:
        return [payload]
    generations = getattr(_local, "generation", None)
    if generations is None:
        generations = _local.generation = collections.Counter()
    generations[tag] += 1
    store = getattr(_local, "store", None)
    if store is None:
        store = _local.store = dist.PrefixStore("fake-xla-rendezvous", _store())
    prefix = f"{tag}/{generations[tag]}"
    store.set(f"{prefix}/{ordinal()}", payload)
    keys = [f"{prefix}/{i}" for i in range(world_size())]
    store.wait(keys)
    return [bytes(store.get(key)) for key in keys]
