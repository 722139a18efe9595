"""torch_xla._internal.pjrt, faked: the same structure and constraints as torch_xla 2.9's."""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing

import torch_xla
import torch_xla.core.xla_model as xm
from torch_xla import _fake, runtime


def _merge_replica_results(replica_results: list[tuple[int, Any]]) -> dict[int, Any]:
    counts = collections.Counter(ordinal for ordinal, _ in replica_results)
    replica, num_results = counts.most_common(1)[0]
    assert num_results == 1, f"{num_results} results for replica {replica}"
    return dict(replica_results)


def _run_thread_per_device(
    local_rank: int,
    local_world_size: int,
    fn: Callable[[], Any],
    initializer_fn: Callable[[int, int], None],
) -> dict[int, Any]:
    initializer_fn(local_rank, local_world_size)
    devices = xm.get_xla_supported_devices()
    first = local_rank * len(devices)

    def _thread_fn(index: int) -> Any:
        _fake.set_replica(first + index, first_of_process=index == 0)
        return fn()

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(devices)) as executor:
        results = list(
            zip(range(first, first + len(devices)), executor.map(_thread_fn, range(len(devices))))
        )
    return _merge_replica_results(results)


def _run_singleprocess(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    _fake.set_replica(0)
    initialize_singleprocess()
    return fn(*args, **kwargs)


def initialize_singleprocess() -> None:
    os.environ.setdefault("PJRT_LOCAL_PROCESS_COUNT", "1")
    xm.set_replication(torch_xla.device(), [])


def initialize_multiprocess(local_rank: int, local_world_size: int) -> None:
    os.environ.setdefault("PJRT_LOCAL_PROCESS_RANK", str(local_rank))
    os.environ.setdefault("PJRT_LOCAL_PROCESS_COUNT", str(local_world_size))
    if runtime.device_type() == "TPU":
        # As tpu.configure_topology: setdefault, so addresses preset for one process (as on
        # Kaggle, pytorch/xla#8215) leave every process but one without a peer.
        addresses = [f"localhost:{8476 + i}" for i in range(local_world_size)]
        os.environ.setdefault("TPU_PROCESS_ADDRESSES", ",".join(addresses))
        os.environ.setdefault("CLOUD_TPU_TASK_ID", str(local_rank))
        os.environ.setdefault("TPU_VISIBLE_CHIPS", str(local_rank))
        listed = os.environ["TPU_PROCESS_ADDRESSES"].split(",")
        if len(listed) != local_world_size:
            raise RuntimeError(
                f"fake TPU runtime: TPU_PROCESS_ADDRESSES lists {len(listed)} process(es) but "
                f"{local_world_size} were started"
            )
    xm.set_replication(torch_xla.device(), xm.get_xla_supported_devices())
    _fake.wait_for_all_processes(local_world_size)


def run_multiprocess(
    fn: Callable[..., Any], *args: Any, start_method: str = "spawn", **kwargs: Any
) -> dict[int, Any]:
    if torch_xla._XLAC._xla_runtime_is_initialized():
        raise RuntimeError(
            "Runtime is already initialized. Do not use the XLA device before calling xmp.spawn."
        )
    num_processes = _fake.chips() if runtime.device_type() == "TPU" else 1
    # The fake interconnect: a store the replicas meet at, served by this process.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ["FAKE_XLA_STORE"] = f"127.0.0.1:{store.port}"
    os.environ["FAKE_XLA_WORLD_SIZE"] = str(num_processes * _fake.devices_per_process())
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=num_processes, mp_context=torch.multiprocessing.get_context(start_method)
    ) as executor:
        mp_fn = functools.partial(
            _run_thread_per_device,
            local_world_size=num_processes,
            fn=functools.partial(fn, *args, **kwargs),
            initializer_fn=initialize_multiprocess,
        )
        process_results = executor.map(mp_fn, range(num_processes))
        replica_results = list(itertools.chain.from_iterable(r.items() for r in process_results))
    return _merge_replica_results(replica_results)


class _SpawnFn:
    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> None:
        self.fn(runtime.global_ordinal(), *self.args, **self.kwargs)


def spawn(
    fn: Callable[..., Any],
    nprocs: int | None = None,
    start_method: str = "spawn",
    args: tuple[Any, ...] = (),
) -> None:
    spawn_fn = _SpawnFn(fn, *args)
    if nprocs == 1:
        return _run_singleprocess(spawn_fn)
    elif nprocs is not None:
        raise ValueError(
            f"Unsupported nprocs ({nprocs}). Please use nprocs=1 or None (default). If None, spawn "
            "will use all available devices. Use the environment variable X_NUM_DEVICES (where X "
            "is CPU, TPU, NEURONCORE, etc) to limit the number of devices used."
        )
    run_multiprocess(spawn_fn, start_method=start_method)
