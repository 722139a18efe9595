"""torch_xla.distributed.xla_backend, faked: the "xla" process group is gloo underneath."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from torch_xla import runtime


def _create_xla_process_group(store: Any, rank: int, size: int, timeout: Any) -> Any:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _rendezvous_handler(url: str, timeout: Any = None, **kwargs: Any) -> Any:
    # As torch_xla's pjrt_rendezvous_handler: the agent's store when torchrun-style
    # variables say so, ranks and size from the runtime.
    host = os.environ.get("MASTER_ADDR", "localhost")
    port = int(os.environ.get("MASTER_PORT", "12355"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.PrefixStore("/worker/attempt_0",
                                 dist.TCPStore(host, port, runtime.process_count(), is_master=False))
    else:
        store = dist.TCPStore(host, port, runtime.process_count(),
                              is_master=runtime.process_index() == 0)
    yield (store, runtime.global_ordinal(), runtime.world_size())


if "xla" not in dist.Backend.backend_list:
    dist.Backend.register_backend("xla", _create_xla_process_group, devices="cpu")
dist.register_rendezvous_handler("xla", _rendezvous_handler)
