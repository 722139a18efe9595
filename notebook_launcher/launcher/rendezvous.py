"""Where a launch's ranks meet: on this machine alone, or across machines.

Each attempt of a launch (the first, and each elastic restart) is one *round*: it says
which group rank this machine holds, how many machines take part, and where the store
the ranks connect to (``MASTER_ADDR:MASTER_PORT``) listens. A fresh worker store serves
every round, as torch elastic's agent makes a new one for every retry, so keys of a
failed attempt never confuse the next.

- One machine (``num_nodes=1``, no ``rdzv_endpoint``): the kernel hosts the store on
  ``master_addr`` (loopback by default) for each round. Nothing else is involved.
- Several machines: the kernels meet through torch.distributed's own rendezvous.
  ``"static"``: the machine with ``node_rank=0`` hosts the rendezvous store at
  ``rdzv_endpoint`` (else ``master_addr:use_port``), and group ranks are the node ranks.
  ``"c10d"``: torch's ``DynamicRendezvousHandler`` over ``C10dRendezvousBackend`` assigns
  the group ranks (as torchrun does, in the order of its own sorting, not by
  ``node_rank``). The kernel of group rank 0 then hosts the round's worker store and
  publishes its address through the rendezvous store.

Every store listens only on the address it was given (never on all interfaces): the
rendezvous store on the endpoint's host, the worker store on the same host where this
machine has it, else on ``rdzv_conf["local_addr"]`` or this machine's own name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Union

from notebook_launcher.errors import LaunchConfigError, LaunchError
from notebook_launcher.launcher.store import RendezvousStore, bind_listener

if TYPE_CHECKING:
    from notebook_launcher.launcher.plan import LaunchPlan

_STATIC_DEFAULT_PORT = 29500  # accelerate's and torchrun's defaults
_C10D_DEFAULT_PORT = 29400
_WORKER_STORE_KEY = "notebook_launcher/worker_store"
_CLOSING_KEY = "notebook_launcher/closing"
_DEFAULT_JOIN_TIMEOUT_S = 600.0
_CONNECT_TRY_S = 5.0
_RETRY_S = 0.2


class RendezvousError(LaunchError):
    """The machines of a multi-node launch could not meet."""


@dataclasses.dataclass(frozen=True)
class RendezvousConfig:
    """The multi-node arguments of a launch, checked."""

    backend: str  # "static" or "c10d"
    num_nodes: int
    node_rank: int
    endpoint: str  # "host:port", or "" for master_addr:use_port
    run_id: str
    conf: dict[str, Any]

    @property
    def join_timeout_s(self) -> float:
        value = self.conf.get("join_timeout", self.conf.get("timeout", _DEFAULT_JOIN_TIMEOUT_S))
        return float(value)


@dataclasses.dataclass
class Round:
    group_rank: int
    num_nodes: int
    master_addr: str  # the worker store the ranks connect to
    master_port: int
    worker_store: RendezvousStore | None  # hosted by this kernel for this round

    def close(self) -> None:
        if self.worker_store is not None:
            self.worker_store.close()
            self.worker_store = None


class LocalRendezvous:
    """One machine: each round, a fresh store on ``master_addr`` hosted by the kernel."""

    def __init__(self, master_addr: str, port: int | None, nproc: int) -> None:
        self._master_addr = master_addr
        self._port = port
        self._world_size = nproc
        # Bound now, so a busy use_port fails before anything starts.
        self._listener: socket.socket | None = bind_listener(master_addr, port)

    def next_round(self, attempt: int) -> Round:
        listener = self._listener or bind_listener(self._master_addr, self._port)
        self._listener = None
        store = RendezvousStore(listener, self._world_size)
        return Round(0, 1, self._master_addr, store.port, store)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class NodeRendezvous:
    """Several machines, through torch.distributed's rendezvous (static or c10d)."""

    def __init__(self, config: RendezvousConfig, master_addr: str, port: int | None, nproc: int) -> None:
        self._config = config
        self._nproc = nproc
        default_port = _C10D_DEFAULT_PORT if config.backend == "c10d" else _STATIC_DEFAULT_PORT
        endpoint = config.endpoint or f"{_bracket(master_addr)}:{port or default_port}"
        self._host, self._port = parse_endpoint(endpoint, default_port)
        self._endpoint = endpoint
        self._hosting = False
        self._store: Any = self._open_store()
        self._handler: Any = None
        if config.backend == "c10d":
            self._handler = _dynamic_handler(config, self._store, self._host)

    def _open_store(self) -> Any:
        """Host the rendezvous store, or connect to the one hosted for *this* launch.

        A store that says it is closing belongs to the previous launch (its host has not
        released it yet): wait for the new one.
        """
        from torch.distributed import TCPStore

        config = self._config
        deadline = time.monotonic() + config.join_timeout_s
        may_host = self._should_host()
        while True:
            if may_host is not False:
                try:
                    listener = bind_listener(self._host, self._port)
                except LaunchConfigError:
                    # c10d: another kernel on this machine hosts it already (torch's own rule).
                    if may_host is True and time.monotonic() > deadline:
                        raise
                else:
                    self._hosting = True
                    return TCPStore(
                        self._host, self._port, None, is_master=True,
                        timeout=timedelta(seconds=config.join_timeout_s), wait_for_workers=False,
                        master_listen_fd=listener.detach(), use_libuv=True,
                    )
                if may_host is True:
                    time.sleep(_RETRY_S)
                    continue
            remaining = deadline - time.monotonic()
            try:
                store = TCPStore(
                    self._host, self._port, None, is_master=False,
                    timeout=timedelta(seconds=max(0.1, min(remaining, _CONNECT_TRY_S))),
                )
                if not store.check([_CLOSING_KEY]):
                    return store
                error: Exception = RuntimeError("only the previous launch's store answered")
            except Exception as failed:
                error = failed
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"node_rank={config.node_rank} could not reach the rendezvous store at "
                    f"{self._endpoint} within {config.join_timeout_s:g}s: {error}. Start the "
                    "launch on the machine that hosts it too (node_rank=0 for 'static'), and "
                    "check that the address and port are reachable from here."
                ) from error
            time.sleep(_RETRY_S)

    def _should_host(self) -> bool | None:
        """True: must host; False: must not; None: host if nobody does yet (c10d)."""
        if self._config.backend == "static":
            return self._config.node_rank == 0
        is_host = self._config.conf.get("is_host")
        if is_host is not None:
            return _truthy(is_host)
        return None if _is_local_address(self._host) else False

    def next_round(self, attempt: int) -> Round:
        from torch.distributed import PrefixStore

        config = self._config
        if self._handler is not None:
            with _no_shared_store_server():
                info = self._handler.next_rendezvous()
            group_rank, num_nodes, store = info.rank, info.world_size, info.store
        else:
            group_rank, num_nodes = config.node_rank, config.num_nodes
            store = PrefixStore(f"{config.run_id}/round{attempt}", self._store)
        worker_store = None
        if group_rank == 0:
            listener = bind_listener(self._worker_host(), None)
            worker_store = RendezvousStore(listener, num_nodes * self._nproc)
            store.set(_WORKER_STORE_KEY, f"{worker_store.address} {worker_store.port}")
        try:
            address, port = store.get(_WORKER_STORE_KEY).decode().rsplit(" ", 1)
        except Exception as error:
            if worker_store is not None:
                worker_store.close()
            raise RendezvousError(
                f"node_rank={config.node_rank}: the machine of group rank 0 never published "
                f"the ranks' store within {config.join_timeout_s:g}s ({error}). Check that every "
                f"machine launched with num_nodes={config.num_nodes} and rdzv_id={config.run_id!r}."
            ) from error
        return Round(group_rank, num_nodes, address, int(port), worker_store)

    def _worker_host(self) -> str:
        local = self._config.conf.get("local_addr")
        if local:
            return str(local)
        return self._host if _is_local_address(self._host) else socket.getfqdn()

    def finish(self) -> None:
        """Wait for every machine to finish before the store they share goes away."""
        from torch.distributed.elastic.utils.store import barrier

        config = self._config
        if self._handler is not None:
            # While the store is surely up: the first machine through closes the rendezvous.
            with contextlib.suppress(Exception):
                self._handler.shutdown()
            self._handler = None
        try:
            barrier(self._store, config.num_nodes, f"{config.run_id}/exit",
                    barrier_timeout=config.join_timeout_s)
            # The host marks its store as closing before anyone leaves, so that a machine
            # already starting its next launch never mistakes this store for the new one;
            # and it keeps the store alive until every other machine is through.
            left = f"{config.run_id}/exit/left"
            if not self._hosting:
                self._store.wait([_CLOSING_KEY])
                self._store.add(left, 1)
                return
            self._store.set(_CLOSING_KEY, "1")
            deadline = time.monotonic() + config.join_timeout_s
            while self._store.add(left, 0) < config.num_nodes - 1:
                if time.monotonic() > deadline:
                    raise TimeoutError("machines still leaving")
                time.sleep(0.05)
        except Exception as error:
            raise RendezvousError(
                f"node_rank={config.node_rank}: this machine's ranks finished, but not every "
                f"machine of the launch reached the end within {config.join_timeout_s:g}s "
                f"({error})."
            ) from error

    def close(self) -> None:
        if self._handler is not None:
            with contextlib.suppress(Exception):  # the host may already be gone
                self._handler.shutdown()
            self._handler = None
        if self._hosting and self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(_CLOSING_KEY, "1")
        self._store = None  # a hosted store stops listening when released


Rendezvous = Union[LocalRendezvous, NodeRendezvous]


def config_of(plan: LaunchPlan) -> RendezvousConfig | None:
    """The plan's multi-node arguments; None for one machine without an endpoint (the
    kernel hosts the store itself: the static and c10d backends would agree)."""
    if plan.num_nodes == 1 and not plan.rdzv_endpoint:
        return None
    return RendezvousConfig(
        backend=plan.rdzv_backend, num_nodes=plan.num_nodes, node_rank=plan.node_rank,
        endpoint=plan.rdzv_endpoint, run_id=plan.rdzv_id, conf=dict(plan.rdzv_conf),
    )


def open_rendezvous(
    config: RendezvousConfig | None, master_addr: str, port: int | None, nproc: int
) -> Rendezvous:
    if config is None:
        return LocalRendezvous(master_addr, port, nproc)
    return NodeRendezvous(config, master_addr, port, nproc)


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        return parse_rendezvous_endpoint(endpoint, default_port)
    except ValueError as error:
        raise LaunchConfigError(
            f"rdzv_endpoint={endpoint!r} is not a 'host:port' address ({error}). Give the "
            "address of the machine that hosts the rendezvous, e.g. '10.0.0.1:29400'."
        ) from error


def _dynamic_handler(config: RendezvousConfig, store: Any, host: str) -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    def seconds(key: str) -> timedelta | None:
        return timedelta(seconds=float(config.conf[key])) if key in config.conf else None

    backend = C10dRendezvousBackend(store, config.run_id)
    return DynamicRendezvousHandler.from_backend(
        run_id=config.run_id,
        store=store,
        backend=backend,
        min_nodes=config.num_nodes,
        max_nodes=config.num_nodes,
        local_addr=config.conf.get("local_addr") or (host if _is_local_address(host) else None),
        timeout=RendezvousTimeout(
            join=timedelta(seconds=config.join_timeout_s),
            last_call=seconds("last_call_timeout"),
            close=seconds("close_timeout"),
        ),
    )


@contextlib.contextmanager
def _no_shared_store_server() -> Iterator[None]:
    """Keep torch's handler from starting its own store server, which listens on every
    interface; the worker store is ours, bound to one address."""
    name = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    saved = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def _is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine (torch's c10d rendezvous asks the same)."""
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.bind((host, 0))
        return True
    return False


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "y")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host

