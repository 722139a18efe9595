"""Where a launch's ranks meet: on this machine alone, or across machines.

Each attempt of a launch (the first, and each elastic restart) is one *round*: it says
which group rank this machine holds, how many machines take part, and where the store
the ranks connect to (``MASTER_ADDR:MASTER_PORT``) listens. A fresh worker store serves
every round, as torch elastic's agent makes a new one for every retry, so keys of a
failed attempt never confuse the next.

- One machine (``num_nodes=1``, no ``rdzv_endpoint``): the kernel hosts the store on
  ``master_addr`` (loopback by default) for each round. Nothing else is involved.
- Several machines: the kernels meet through torch.distributed's own rendezvous, in the
  way ``rdzv_backend`` names: a registered strategy (``rendezvous_strategies``: "static",
  where the machine with ``node_rank=0`` hosts the rendezvous store at ``rdzv_endpoint``
  and group ranks are the node ranks; "c10d", where torch's dynamic rendezvous assigns
  them). The kernel of group rank 0 then hosts the round's worker store and publishes its
  address through the rendezvous store.

Every store listens only on the address it was given (never on all interfaces): the
rendezvous store on the endpoint's host, the worker store on the same host where this
machine has it, else on ``rdzv_conf["local_addr"]`` or this machine's own name.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import json
import os
import socket
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

from notebook_launcher.errors import (
    LaunchConfigError,
    RendezvousError,
    RendezvousTimeoutError,
)
from notebook_launcher.launcher.events import LaunchEvent, RendezvousWaiting
from notebook_launcher.launcher.rendezvous_strategies import (
    STRATEGIES,
    RendezvousConfig,
    is_local_address,
    lines,
)
from notebook_launcher.launcher.store import (
    PortInUseError,
    RendezvousStore,
    bind_listener,
    derived_secret,
    new_secret,
    probe_store,
    protected,
    store_on_socket,
)

if TYPE_CHECKING:
    from notebook_launcher.launcher.plan import LaunchPlan

_WORKER_STORE_KEY = "notebook_launcher/worker_store"
_CLOSING_KEY = "notebook_launcher/closing"
_RETRY_S = 0.2
_REFUSAL_WAIT_S = 10.0  # how long a host keeps its store for machines that refuse too
_PROBE_S = 2.0
_FIRST_WAIT_LINE_S = 1.0  # a peer that comes at once is not worth a line
_WAIT_LINE_EVERY_S = 5.0
# What every machine of a launch must agree on; the rendezvous refuses a launch otherwise.
AGREED = ("num_nodes", "num_processes", "mixed_precision", "function")


Emit = Callable[[LaunchEvent], None]
_Method = TypeVar("_Method", bound=Callable[..., Any])


def _releasing_stores(method: _Method) -> _Method:
    """A store held by a frame of a raised error's traceback stays open, and keeps its port,
    for as long as the notebook keeps the error (``sys.last_value``): let go of them."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except BaseException as error:
            seen: set[int] = set()
            link: BaseException | None = error
            while link is not None and id(link) not in seen:
                seen.add(id(link))
                traceback.clear_frames(link.__traceback__)
                link = link.__cause__ or link.__context__
            raise

    return cast(_Method, wrapper)


@dataclasses.dataclass
class Round:
    group_rank: int
    num_nodes: int
    master_addr: str  # the worker store the ranks connect to
    master_port: int
    worker_store: RendezvousStore | None  # hosted by this kernel for this round
    secret: str | None = None  # every key the ranks use lives under it

    def serve(self) -> None:
        """Start this kernel's store for the round, if it hosts one not yet started."""
        if self.worker_store is not None:
            self.worker_store.serve()

    def close(self) -> None:
        if self.worker_store is not None:
            self.worker_store.close()
            self.worker_store = None


class Rendezvous(abc.ABC):
    """Where a launch's ranks meet, round after round (one per attempt)."""

    @abc.abstractmethod
    def next_round(self, attempt: int) -> Round:
        """This machine's place in attempt ``attempt``, once every machine joined it."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Every machine's ranks finished: wait for the others before the store goes."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free what the rendezvous holds (its listener, its store); called on every path."""


class LocalRendezvous(Rendezvous):
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
        # Started by Round.serve() once the ranks are, in the time they take to start.
        store = RendezvousStore(listener, self._world_size, new_secret(), serve_now=False)
        return Round(0, 1, self._master_addr, store.port, store, store.secret)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class _Clock:
    """The rendezvous's limit: join_timeout, or what is left of the launch's timeout=."""

    def __init__(
        self, join_timeout_s: float, launch_deadline: float | None, launch_timeout_s: float | None
    ) -> None:
        self.started = time.monotonic()
        self._join = (self.started + join_timeout_s, f"join_timeout={join_timeout_s:g}s")
        self._launch = (
            (
                launch_deadline,
                f"timeout={launch_timeout_s:g}s (the launch's limit, rendezvous included)",
            )
            if launch_deadline is not None
            else None
        )

    def _limit(self) -> tuple[float, str]:
        if self._launch is not None and self._launch[0] < self._join[0]:
            return self._launch
        return self._join

    @property
    def words(self) -> str:
        return self._limit()[1]

    def remaining(self) -> float:
        return self._limit()[0] - time.monotonic()

    def limit_s(self) -> float:
        return self._limit()[0] - self.started

    def waited(self) -> float:
        return time.monotonic() - self.started

    def restart(self) -> None:
        """Each round has its own join_timeout; the launch's deadline stays."""
        join_s = self._join[0] - self.started
        self.started = time.monotonic()
        self._join = (self.started + join_s, self._join[1])


class NodeRendezvous(Rendezvous):
    """Several machines, through torch.distributed's rendezvous (a registered
    :class:`Strategy`: static or c10d)."""

    @_releasing_stores
    def __init__(
        self,
        config: RendezvousConfig,
        master_addr: str,
        port: int | None,
        nproc: int,
        *,
        fingerprint: dict[str, Any] | None = None,
        deadline: float | None = None,
        timeout_s: float | None = None,
        emit: Emit | None = None,
    ) -> None:
        self._config = config
        self._nproc = nproc
        self._strategy = STRATEGIES[config.backend](config)
        default_port = self._strategy.default_port
        endpoint = config.endpoint or f"{_bracket(master_addr)}:{port or default_port}"
        self._host, self._port = parse_endpoint(endpoint, default_port)
        self._endpoint = endpoint
        if config.endpoint:
            self._source = f"rdzv_endpoint={config.endpoint!r}"
        elif port:
            self._source = f"use_port={port}"
        else:
            self._source = f"master_addr={master_addr!r} with the default port {default_port}"
        # Without a shared secret the keys are only set apart from other launches, not hidden.
        self._secret = derived_secret(config.secret or "", endpoint)
        self._me = {
            **(fingerprint or {}),
            "node_rank": config.node_rank,
            "num_nodes": config.num_nodes,
            "num_processes": nproc,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        self._clock = _Clock(config.join_timeout_s, deadline, timeout_s)
        self._emit = emit
        self._last_line = -_WAIT_LINE_EVERY_S
        self._hosting = False
        self._store: Any = self._open_store()
        self._keys: Any = protected(self._store, self._secret)
        self._strategy.joined(self)

    # what a strategy reads ------------------------------------------------------------

    @property
    def keys(self) -> Any:
        """The rendezvous store, under this launch's secret."""
        return self._keys

    @property
    def host(self) -> str:
        return self._host

    @property
    def clock(self) -> _Clock:
        return self._clock

    @property
    def me(self) -> dict[str, Any]:
        """What this machine says of itself to the others."""
        return self._me

    # the rendezvous store --------------------------------------------------------------

    def _open_store(self) -> Any:
        """Host the rendezvous store, or connect to the one hosted for *this* launch.

        Only what may succeed later is tried again: a store not there yet, or one that
        says it is closing (the previous launch's, not yet released by its host). A port
        held by another program is final.
        """
        from torch.distributed import TCPStore

        config = self._config
        may_host = self._should_host()
        while True:
            if may_host is not False:
                try:
                    listener = bind_listener(self._host, self._port, source=self._source)
                except PortInUseError:
                    if may_host is True:
                        raise
                    # c10d: another kernel on this machine may host it already (torch's own rule).
                else:
                    self._hosting = True
                    return store_on_socket(
                        listener, None, timedelta(seconds=max(1.0, self._clock.limit_s()))
                    )
            found = probe_store(
                self._host, self._port, max(0.1, min(_PROBE_S, self._clock.remaining()))
            )
            if found == "other":
                raise RendezvousError(
                    f"node_rank={config.node_rank}: {self._source}: the program listening on "
                    f"{self._host}:{self._port} is not a rendezvous store (it does not answer as "
                    "torch's TCPStore). Point rdzv_endpoint at the machine that hosts the "
                    "launch's rendezvous, or end the program that holds the port."
                )
            if found == "store":
                # A store that closes between the probe and the connect makes torch's
                # client retry, with a C++ stack trace each time, for as long as its
                # timeout: it gets the probe's short one, and the launch's once connected.
                # The previous launch's store may also close between the connect and the
                # question whether it is closing: that too is a store to wait for.
                try:
                    store = TCPStore(
                        self._host,
                        self._port,
                        None,
                        is_master=False,
                        timeout=timedelta(seconds=max(0.1, min(_PROBE_S, self._clock.remaining()))),
                    )
                    store.set_timeout(timedelta(seconds=max(1.0, self._clock.limit_s())))
                    closing = protected(store, self._secret).check([_CLOSING_KEY])
                except Exception:
                    state = "a store answered there, then closed before it could be joined"
                else:
                    if not closing:
                        return store
                    state = "only the previous launch's store answered; it is closing"
            else:
                state = "nothing listens there yet"
            if self._clock.remaining() <= 0:
                hint = (
                    "Start the launch on the machine that hosts it too (node_rank=0 for "
                    "'static'), and check that the address and port are reachable from here."
                )
                raise RendezvousTimeoutError(
                    f"node_rank={config.node_rank} could not reach the rendezvous store at "
                    f"{self._endpoint} within {self._clock.words} ({state}). {hint}"
                )
            self._waiting(
                "the rendezvous store",
                (),
                (),
                f"node_rank={config.node_rank} waits for the rendezvous store at {self._endpoint} "
                f"({state}; node_rank=0 hosts it)",
            )
            time.sleep(_RETRY_S)

    def _should_host(self) -> bool | None:
        """True: must host; False: must not; None: host if nobody does yet (c10d)."""
        return self._strategy.should_host(self._host)

    def _waiting(
        self, what: str, joined: tuple[int, ...], missing: tuple[int, ...], line: str
    ) -> None:
        waited = self._clock.waited()
        if (
            self._emit is None
            or waited < _FIRST_WAIT_LINE_S
            or waited - self._last_line < _WAIT_LINE_EVERY_S
        ):
            return
        self._last_line = waited
        self._emit(
            RendezvousWaiting(
                what,
                joined,
                missing,
                waited,
                self._clock.limit_s(),
                f"{line}, {waited:.0f}s of {self._clock.words}",
            )
        )

    # each round -----------------------------------------------------------------------

    @_releasing_stores
    def next_round(self, attempt: int) -> Round:
        config = self._config
        if attempt > 0:
            self._clock.restart()
            self._last_line = -_WAIT_LINE_EVERY_S
        group_rank, num_nodes, store = self._strategy.round(self, attempt)
        self._meet(store, group_rank, num_nodes)
        secret = derived_secret(self._secret, config.run_id, "workers", str(attempt))
        worker_store = None
        if group_rank == 0:
            listener = bind_listener(self._worker_host(), None)
            worker_store = RendezvousStore(listener, num_nodes * self._nproc, secret)
            store.set(_WORKER_STORE_KEY, f"{worker_store.address} {worker_store.port}")
        try:
            address, port = store.get(_WORKER_STORE_KEY).decode().rsplit(" ", 1)
        except Exception as error:
            if worker_store is not None:
                worker_store.close()
            raise RendezvousError(
                f"node_rank={config.node_rank}: the machine of group rank 0 joined but never "
                f"published the ranks' store ({type(error).__name__}: {error}). It may have "
                "stopped; look at its output."
            ) from error
        return Round(group_rank, num_nodes, address, int(port), worker_store, secret)

    def _meet(self, store: Any, group_rank: int, num_nodes: int) -> None:
        """Wait until every machine of the round said who it is; refuse disagreement."""
        config = self._config
        if store.add(f"claimed/{group_rank}", 1) > 1:
            raise RendezvousError(
                f"node_rank={group_rank} is taken: another machine of rdzv_id={config.run_id!r} "
                f"joined with node_rank={group_rank} too. Give each machine its own node_rank, "
                f"from 0 to {config.num_nodes - 1}."
            )
        store.set(f"machine/{group_rank}", json.dumps({**self._me, "group_rank": group_rank}))
        while True:
            machines = [
                json.loads(store.get(f"machine/{r}"))
                for r in range(num_nodes)
                if store.check([f"machine/{r}"])
            ]
            self.refuse_disagreement(machines, store, "refused")
            joined = tuple(m["group_rank"] for m in machines)
            missing = tuple(r for r in range(num_nodes) if r not in joined)
            if not missing:
                return
            names = ", ".join(str(r) for r in missing)
            if self._clock.remaining() <= 0:
                raise RendezvousTimeoutError(
                    f"node_rank={config.node_rank}: {len(joined)} of num_nodes={num_nodes} "
                    f"machines joined the rendezvous at {self._endpoint} (rdzv_id="
                    f"{config.run_id!r}) within {self._clock.words}: joined "
                    f"{_describe(machines)}; node_rank {names} did not. Start the launch on "
                    f"the missing machine(s) with the same rdzv_endpoint and rdzv_id, and check "
                    f"that they reach {self._endpoint}."
                )
            self._waiting(
                "machines",
                joined,
                missing,
                f"node_rank={config.node_rank} waits for node_rank {names} at {self._endpoint} "
                f"({len(joined)} of {num_nodes} machines joined)",
            )
            time.sleep(_RETRY_S)

    def refuse_disagreement(
        self, machines: list[dict[str, Any]], store: Any, refused_key: str
    ) -> None:
        """Refuse (RendezvousError) where the machines that joined disagree on what they
        must agree on, after holding ``store`` for the others' refusals."""
        problem = self._disagreement(machines)
        if problem is not None:
            self._hold_store_for_refusals(store, refused_key, machines)
            raise RendezvousError(problem)

    def _hold_store_for_refusals(
        self, store: Any, refused_key: str, machines: list[dict[str, Any]]
    ) -> None:
        """Each machine that joined refuses too; the host keeps its store until they have
        (bounded), or a machine a moment behind would find the store gone instead of the
        values it disagrees with."""
        # A machine is counted once, however many times its line was read.
        joined = len({(m["host"], m["pid"], m["node_rank"]) for m in [*machines, self._me]})
        with contextlib.suppress(Exception):  # the refusal itself is what matters
            store.add(refused_key, 1)
            if not self._hosting:
                return
            deadline = time.monotonic() + min(_REFUSAL_WAIT_S, max(0.0, self._clock.remaining()))
            while store.add(refused_key, 0) < joined and time.monotonic() < deadline:
                time.sleep(0.05)

    def _disagreement(self, machines: list[dict[str, Any]]) -> str | None:
        """What the machines disagree on, in words; None where they agree."""
        me = self._me
        everyone = list(machines)
        if not any(m["pid"] == me["pid"] and m["host"] == me["host"] for m in everyone):
            everyone.append(me)
        everyone.sort(key=lambda m: (m["node_rank"], m["host"], m["pid"]))
        for name in AGREED:
            if name in me and len({repr(m.get(name)) for m in everyone}) > 1:
                said = ", ".join(
                    f"node_rank={m['node_rank']} ({m['host']}, pid {m['pid']}) has {name}={m.get(name)!r}"
                    for m in everyone
                )
                return (
                    f"the machines of rdzv_id={self._config.run_id!r} disagree on {name}: {said}. "
                    f"Launch every machine with the same {name}."
                )
        return None

    def c10d_failure(self, error: Exception, announced: str) -> RendezvousError:
        config = self._config
        machines = lines(self._keys.get(announced)) if self._keys.check([announced]) else [self._me]
        cause = type(error).__name__ + (f": {error}" if str(error) else "")
        timed_out = "Timeout" in type(error).__name__
        kind = RendezvousTimeoutError if timed_out else RendezvousError
        what = f"did not complete within {self._clock.words}" if timed_out else "failed"
        return kind(
            f"node_rank={config.node_rank}: the c10d rendezvous at {self._endpoint} (rdzv_id="
            f"{config.run_id!r}) {what} ({cause}): {len(machines)} of num_nodes="
            f"{config.num_nodes} machines joined: {_describe(machines)}. Start the launch on "
            "every machine with rdzv_backend='c10d', the same rdzv_endpoint, rdzv_id and "
            f"num_nodes, and check that each reaches {self._endpoint}."
        )

    def _worker_host(self) -> str:
        local = self._config.conf.get("local_addr")
        if local:
            return str(local)
        return self._host if is_local_address(self._host) else socket.getfqdn()

    @_releasing_stores
    def finish(self) -> None:
        """Wait for every machine to finish before the store they share goes away."""
        from torch.distributed.elastic.utils.store import barrier

        config = self._config
        self._strategy.leave()
        try:
            barrier(
                self._keys,
                config.num_nodes,
                f"{config.run_id}/exit",
                barrier_timeout=config.join_timeout_s,
            )
            # The host marks its store as closing before anyone leaves, so that a machine
            # already starting its next launch never mistakes this store for the new one;
            # and it keeps the store alive until every other machine is through.
            left = f"{config.run_id}/exit/left"
            if not self._hosting:
                self._keys.wait([_CLOSING_KEY])
                self._keys.add(left, 1)
                return
            self._keys.set(_CLOSING_KEY, "1")
            deadline = time.monotonic() + config.join_timeout_s
            while self._keys.add(left, 0) < config.num_nodes - 1:
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
        self._strategy.leave()
        if self._hosting and self._store is not None:
            with contextlib.suppress(Exception):
                self._keys.set(_CLOSING_KEY, "1")
        self._store = self._keys = None  # a hosted store stops listening when released


def _describe(machines: list[dict[str, Any]]) -> str:
    return (
        ", ".join(
            f"node_rank={m.get('group_rank', m['node_rank'])} ({m['host']}, pid {m['pid']})"
            for m in machines
        )
        or "none"
    )


def config_of(plan: LaunchPlan) -> RendezvousConfig | None:
    """The plan's multi-node arguments; None for one machine without an endpoint (the
    kernel hosts the store itself: the static and c10d backends would agree)."""
    if plan.num_nodes == 1 and not plan.rdzv_endpoint:
        return None
    return RendezvousConfig(
        backend=plan.rdzv_backend,
        num_nodes=plan.num_nodes,
        node_rank=plan.node_rank,
        endpoint=plan.rdzv_endpoint,
        run_id=plan.rdzv_id,
        conf=dict(plan.rdzv_conf),
    )


def open_rendezvous(
    config: RendezvousConfig | None,
    master_addr: str,
    port: int | None,
    nproc: int,
    *,
    fingerprint: dict[str, Any] | None = None,
    deadline: float | None = None,
    timeout_s: float | None = None,
    emit: Emit | None = None,
) -> Rendezvous:
    """Where this launch's ranks meet. ``deadline`` (time.monotonic()) is the launch's
    ``timeout=``, which bounds the rendezvous too; ``fingerprint`` is what every machine
    must agree on; ``emit`` receives :class:`RendezvousWaiting` while it waits."""
    if config is None:
        return LocalRendezvous(master_addr, port, nproc)
    return NodeRendezvous(
        config,
        master_addr,
        port,
        nproc,
        fingerprint=fingerprint,
        deadline=deadline,
        timeout_s=timeout_s,
        emit=emit,
    )


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        return parse_rendezvous_endpoint(endpoint, default_port)
    except ValueError as error:
        raise LaunchConfigError(
            f"rdzv_endpoint={endpoint!r} is not a 'host:port' address ({error}). Give the "
            "address of the machine that hosts the rendezvous, e.g. '10.0.0.1:29400'."
        ) from error


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
