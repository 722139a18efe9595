"""How the machines of a launch find their group ranks: one registered strategy per
``rdzv_backend``, behind one interface (as backends are registered by name).

- ``"static"``: the machine with ``node_rank=0`` hosts the rendezvous store, and group ranks
  are the node ranks.
- ``"c10d"``: torch's ``DynamicRendezvousHandler`` over ``C10dRendezvousBackend`` assigns
  the group ranks (as torchrun does, in the order of its own sorting, not by ``node_rank``).

A strategy reads the launch's rendezvous through :class:`Meeting`, which
``rendezvous.NodeRendezvous`` is; what the machines do together (joining the store,
checking they agree, the worker store) is the rendezvous's, the same for every strategy.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, ClassVar, Protocol

from notebook_launcher.errors import LaunchConfigError, LaunchError, RendezvousError

_STATIC_DEFAULT_PORT = 29500  # accelerate's and torchrun's defaults
_C10D_DEFAULT_PORT = 29400
_DEFAULT_JOIN_TIMEOUT_S = 600.0
# The environment variable every machine of a launch may read its shared secret from.
SECRET_ENV = "NOTEBOOK_LAUNCHER_RDZV_SECRET"


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

    @property
    def secret(self) -> str | None:
        """The value the machines share, from rdzv_conf['secret'] or the environment."""
        value = self.conf.get("secret") or os.environ.get(SECRET_ENV) or None
        if value is not None and not isinstance(value, str):
            raise LaunchConfigError(
                f"rdzv_conf['secret'] must be a string every machine of the launch shares; "
                f"got {type(value).__name__}."
            )
        return value


class Clock(Protocol):
    def limit_s(self) -> float: ...


class Meeting(Protocol):
    """What a strategy reads of the launch's rendezvous."""

    @property
    def keys(self) -> Any:
        """The rendezvous store, under the launch's secret."""

    @property
    def host(self) -> str: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def me(self) -> dict[str, Any]:
        """What this machine says of itself to the others."""

    def refuse_disagreement(
        self, machines: list[dict[str, Any]], store: Any, refused_key: str
    ) -> None: ...

    def c10d_failure(self, error: Exception, announced: str) -> RendezvousError: ...


class Strategy(abc.ABC):
    """One ``rdzv_backend``: whether this machine hosts the rendezvous store, and how each
    round gives this machine its group rank. One instance per launch (it may hold the
    launch's state, as c10d's handler); registered by name with :func:`register_strategy`."""

    name: ClassVar[str]  # what users pass as rdzv_backend=
    default_port: ClassVar[int]  # of the rendezvous store, where no port is given

    def __init__(self, config: RendezvousConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def should_host(self, host: str) -> bool | None:
        """True: this machine hosts the rendezvous store at ``host``; False: it must not;
        None: it hosts it where nobody does yet."""

    def joined(self, meeting: Meeting) -> None:
        """The rendezvous store is open; ``meeting`` is the launch's rendezvous."""
        return None

    @abc.abstractmethod
    def round(self, meeting: Meeting, attempt: int) -> tuple[int, int, Any]:
        """This machine's group rank in attempt ``attempt``, the number of machines in it,
        and the store (keys of this round alone) where the machines say who they are."""

    def leave(self) -> None:
        """This machine is through with the rendezvous (called again by close)."""
        return None


STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(strategy: type[Strategy]) -> type[Strategy]:
    """Make ``strategy`` the one for ``rdzv_backend=strategy.name``; returns it."""
    STRATEGIES[strategy.name] = strategy
    return strategy


@register_strategy
class StaticStrategy(Strategy):
    """The machine with ``node_rank=0`` hosts the store; group ranks are the node ranks."""

    name = "static"
    default_port = _STATIC_DEFAULT_PORT

    def should_host(self, host: str) -> bool | None:
        return self.config.node_rank == 0

    def round(self, meeting: Meeting, attempt: int) -> tuple[int, int, Any]:
        from torch.distributed import PrefixStore

        store = PrefixStore(f"{self.config.run_id}/round{attempt}", meeting.keys)
        return self.config.node_rank, self.config.num_nodes, store


@register_strategy
class C10dStrategy(Strategy):
    """torch's ``DynamicRendezvousHandler`` over ``C10dRendezvousBackend`` assigns the group
    ranks, as torchrun does; a kernel on the endpoint's machine hosts the store."""

    name = "c10d"
    default_port = _C10D_DEFAULT_PORT

    def __init__(self, config: RendezvousConfig) -> None:
        super().__init__(config)
        self._handler: Any = None

    def should_host(self, host: str) -> bool | None:
        is_host = self.config.conf.get("is_host")
        if is_host is not None:
            return _truthy(is_host)
        return None if is_local_address(host) else False

    def joined(self, meeting: Meeting) -> None:
        self._handler = _dynamic_handler(
            self.config, meeting.keys, meeting.host, meeting.clock.limit_s()
        )

    def round(self, meeting: Meeting, attempt: int) -> tuple[int, int, Any]:
        announced = f"{self.config.run_id}/attempt{attempt}/machines"
        keys = meeting.keys
        keys.append(announced, json.dumps(meeting.me) + "\n")
        meeting.refuse_disagreement(lines(keys.get(announced)), keys, f"{announced}/refused")
        try:
            with _no_shared_store_server():
                info = self._handler.next_rendezvous()
        except LaunchError:
            raise
        except Exception as error:
            raise meeting.c10d_failure(error, announced) from error
        return info.rank, info.world_size, info.store

    def leave(self) -> None:
        # While the store is surely up: the first machine through closes the rendezvous.
        if self._handler is not None:
            with contextlib.suppress(Exception):  # the host may already be gone
                self._handler.shutdown()
            self._handler = None


def lines(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def _dynamic_handler(config: RendezvousConfig, store: Any, host: str, join_s: float) -> Any:
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
        local_addr=config.conf.get("local_addr") or (host if is_local_address(host) else None),
        timeout=RendezvousTimeout(
            join=timedelta(seconds=max(1.0, join_s)),
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


def is_local_address(host: str) -> bool:
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
