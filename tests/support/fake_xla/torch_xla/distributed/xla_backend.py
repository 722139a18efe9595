"""torch_xla.distributed.xla_backend, faked: the "xla" process group is gloo underneath."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch.distributed as dist

from torch_xla import _fake, runtime
from torch_xla._internal import pjrt


def _create_xla_process_group(store: Any, rank: int, size: int, timeout: Any) -> Any:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


_store: Any = None
_store_lock = threading.Lock()


def _rendezvous_handler(url: str, timeout: Any = None, **kwargs: Any) -> Any:
    # As torch_xla 2.9's pjrt_rendezvous_handler (torch_xla/_internal/rendezvous.py): under
    # torchelastic (TORCHELASTIC_RUN_ID set) it first initialises the multiprocess runtime
    # again from LOCAL_RANK / LOCAL_WORLD_SIZE; then one store per process, the agent's when
    # TORCHELASTIC_USE_AGENT_STORE says so; ranks and size from the runtime.
    global _store
    _fake.calls["rendezvous_handler"] += 1
    if dist.is_torchelastic_launched():
        _fake.calls["rendezvous_handler_reinitialised"] += 1
        local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        if local_world_size > 1:
            pjrt.initialize_multiprocess(local_rank, local_world_size)
        else:
            pjrt.initialize_singleprocess()
    host = os.environ.get("MASTER_ADDR") or "localhost"
    port = int(os.environ.get("MASTER_PORT", "12355"))
    with _store_lock:
        if _store is None:
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
                tcp_store = dist.TCPStore(host, port, runtime.process_count(), is_master=False)
                _store = dist.PrefixStore(f"/worker/attempt_{attempt}", tcp_store)
            else:
                _store = dist.TCPStore(
                    host, port, runtime.process_count(), is_master=runtime.process_index() == 0
                )
    yield (_store, runtime.global_ordinal(), runtime.world_size())


if "xla" not in dist.Backend.backend_list:
    dist.Backend.register_backend("xla", _create_xla_process_group, devices="cpu")
dist.register_rendezvous_handler("xla", _rendezvous_handler)
