"""Ranks as Ray actors: Ray places them (one GPU each where there are GPUs), torch.distributed
connects them through the store this kernel hosts.

Each rank is one actor. The actor forks the rank process itself (``run_rank``, exactly as
a local rank runs), so the rank keeps every promise of a local one: its own process
group, fds 1 and 2 caught at descriptor level (Ray's own log capture never sees them),
death with its parent. Threads in the actor read the rank's pipes and hand the bytes over
in order when the kernel asks (``read``); in the kernel one feeder thread per rank writes
them into the pipes the rank group reads, so output arrives whole-line-safe and nothing
is lost or reordered. Stopping a rank signals it through its actor; SIGKILL kills the
actor (and so the rank). The cluster is the one ``ray_address`` (or ``RAY_ADDRESS``)
names, or a local one started for the launch and shut down after it (on loopback, with a
token of its own: ``ray_local``). A rank whose actor dies without the launcher killing it
(its node left the cluster, its worker was killed) ends with words saying so, naming the
node it ran on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from notebook_launcher.errors import LaunchError, LaunchTypeError, LaunchUnsupportedError
from notebook_launcher.launcher.backends import ray_local
from notebook_launcher.launcher.backends.base import (
    Backend,
    BackendOption,
    Ended,
    RankControl,
    RankEnds,
    RankTarget,
    Started,
)
from notebook_launcher.launcher.pickling import dump_payload

if TYPE_CHECKING:
    from notebook_launcher.launcher.plan_types import LaunchPlan
    from notebook_launcher.launcher.rank import RankSpec

_READ_WAIT_S = 0.2  # how long one ``read`` call waits for output in the actor
_PLACE_TIMEOUT_S = 120.0  # Ray could not place the actors (too few CPUs / GPUs free)
_PROBE_TIMEOUT_S = 5.0  # a raylet that does not take a connection by then is gone
_CHUNK = 1 << 16
# How long the raylet of a node it starts waits for its agents: a busy machine can take
# minutes. Ray reads it from the environment when imported and when its processes start;
# the start waits for the node's registration as long as that raylet lives (ray_local.py).
_START_WAIT_ENV = "RAY_raylet_start_wait_time_s"
_START_WAIT_S = "300"


class RayClusterError(LaunchError):
    """The Ray cluster could not be reached, or could not place the ranks."""


class RankHost:
    """The actor: forks one rank, relays its output and messages, forwards signals."""

    def __init__(self) -> None:
        self._items: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._process: Any = None

    def where(self) -> tuple[str, str]:
        """The node this actor was placed on: its id and address."""
        import ray

        node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # Ray's own
        return ray.get_runtime_context().get_node_id(), node_ip

    def start(self, spec: RankSpec, payload: Any, target: RankTarget) -> int:
        import multiprocessing

        environ = dict(spec.environ)
        if spec.accelerator == "cuda":
            # Ray gives this actor one GPU (CUDA_VISIBLE_DEVICES): the rank sees it as cuda:0.
            environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            environ["LOCAL_RANK"], environ["LOCAL_WORLD_SIZE"] = "0", "1"
            spec = dataclasses.replace(spec, environ=environ, local_rank=0)
        else:
            spec = dataclasses.replace(spec, environ=environ)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        channel_r, channel_w = multiprocessing.Pipe(duplex=False)
        ends = RankEnds(
            Connection(out_w, readable=False), Connection(err_w, readable=False), channel_w
        )
        self._process = multiprocessing.get_context("fork").Process(
            target=target, args=(spec, payload, ends), name=f"notebook_launcher-rank{spec.rank}"
        )
        self._process.start()
        ends.close()
        threading.Thread(target=self._relay, args=(out_r, err_r, channel_r), daemon=True).start()
        return int(self._process.pid)

    def _relay(self, out_r: int, err_r: int, channel: Connection) -> None:
        """Everything the rank writes, in arrival order, then how it ended."""
        with selectors.DefaultSelector() as selector:
            selector.register(out_r, selectors.EVENT_READ, "stdout")
            selector.register(err_r, selectors.EVENT_READ, "stderr")
            selector.register(channel.fileno(), selectors.EVENT_READ, "channel")
            while selector.get_map():
                for key, _ in selector.select():
                    kind = key.data
                    if kind == "channel":
                        try:
                            self._items.put(("channel", channel.recv_bytes()))
                        except (EOFError, OSError):
                            selector.unregister(key.fd)
                        continue
                    data = os.read(key.fd, _CHUNK)
                    if data:
                        self._items.put((kind, data))
                    else:
                        selector.unregister(key.fd)
                        os.close(key.fd)
        channel.close()
        self._process.join()
        self._items.put(("exit", self._process.exitcode))

    def read(self, wait_s: float) -> list[tuple[str, Any]]:
        items = []
        try:
            items.append(self._items.get(timeout=wait_s))
            while True:
                items.append(self._items.get_nowait())
        except queue.Empty:
            pass
        return items

    def signal(self, signum: int) -> None:
        if self._process is None or self._process.exitcode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signum)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self._process.pid, signum)

    def signal_rank(self, signum: int) -> None:
        """The rank's process alone, not what it started."""
        if self._process is None or self._process.exitcode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self._process.pid, signum)


class ActorControl(RankControl):
    """One rank seen from the kernel: its actor, and the thread feeding its pipes."""

    def __init__(self, ray: Any, actor: Any, ends: RankEnds) -> None:
        self._ray = ray
        self._actor = actor
        # The rank group closes its copies of the ends once start() returns.
        self._out = os.dup(ends.stdout.fileno())
        self._err = os.dup(ends.stderr.fileno())
        self._channel = Connection(os.dup(ends.channel.fileno()), readable=False)
        self._ended: Ended | None = None
        self._done = threading.Event()
        self._feeder = threading.Thread(
            target=self._feed, daemon=True, name="notebook_launcher-ray-feed"
        )
        self.node: Node | None = None  # where Ray placed the actor, once it said
        self._killed = False  # the launcher killed the actor: its end says nothing of its node

    def begin(self) -> None:
        self._feeder.start()

    def _feed(self) -> None:
        code: int | None = None
        lost: str | None = None
        try:
            while True:
                items = self._ray.get(self._actor.read.remote(_READ_WAIT_S))
                for kind, data in items:
                    if kind == "stdout":
                        _write_all(self._out, data)
                    elif kind == "stderr":
                        _write_all(self._err, data)
                    elif kind == "channel":
                        self._channel.send_bytes(data)
                    elif kind == "exit":
                        code = data
                        return
        except Exception:  # the actor was killed (or its node lost): the rank died with it
            code = -signal.SIGKILL
            if not self._killed:
                lost = self.loss()
        finally:
            self._close_ends()
            self._ended = Ended(code, lost)
            self._done.set()

    def loss(self) -> str:
        """Why the actor is gone, when the launcher did not end it, in words."""
        if self.node is None:
            return "its Ray actor died before Ray said which node it was placed on"
        state = _node_state(self._ray, self.node.id)
        if state == "unknown":
            return (
                f"its Ray actor on node {self.node} died, and the Ray cluster could not be asked "
                "why (its head node may be gone)"
            )
        if state == "alive":
            return (
                f"its Ray actor on node {self.node} died while the node stayed in the cluster (its "
                "worker process was killed from outside, or ran out of memory), and the rank with it"
            )
        return (
            f"its Ray node {self.node} left the cluster (its raylet stopped, or its machine went "
            "down or off the network), and the rank with it; `ray status` lists the nodes left"
        )

    def _close_ends(self) -> None:
        for fd in (self._out, self._err):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._out = self._err = -1
        if not self._channel.closed:
            self._channel.close()

    def poll(self) -> Ended | None:
        return self._ended

    def signal(self, signum: int) -> None:
        if self._done.is_set():
            return
        if signum == signal.SIGKILL:
            self.kill()
        else:
            with contextlib.suppress(Exception):
                self._actor.signal.remote(signum)

    def signal_rank(self, signum: int) -> None:
        """Through the rank's actor, which signals the rank's process alone (the pid the
        rank reported may be another machine's)."""
        if self._done.is_set():
            return
        with contextlib.suppress(Exception):
            self._actor.signal_rank.remote(signum)

    def kill(self) -> None:
        self._killed = True
        with contextlib.suppress(Exception):
            self._ray.kill(self._actor, no_restart=True)

    def wait(self, timeout: float) -> Ended | None:
        self._done.wait(max(0.0, timeout))
        return self._ended

    def release(self) -> None:
        self.kill()
        if self._feeder.ident is None:  # never started: start() failed before begin()
            self._close_ends()
            self._ended = self._ended or Ended(None)
            self._done.set()
            return
        self._feeder.join(timeout=10)


@dataclasses.dataclass(frozen=True)
class Node:
    """A node of the Ray cluster, as messages name it."""

    id: str
    address: str

    def __str__(self) -> str:
        return f"{self.address} (node id {self.id[:12]})"


def _node_state(ray: Any, node_id: str) -> str:
    """ "alive", "gone", or "unknown" (the cluster cannot be asked).

    The cluster notices a lost node only after missing its heartbeats for a while, seconds
    after the node's actors were seen to die; the node's raylet answers at once: a refused
    or unanswered connection is a raylet that is gone.
    """
    try:
        nodes = ray.nodes()
    except Exception:
        return "unknown"
    node = next((n for n in nodes if n.get("NodeID") == node_id), None)
    if node is None or not node.get("Alive"):
        return "gone"
    try:
        address = (node["NodeManagerAddress"], int(node["NodeManagerPort"]))
        with socket.create_connection(address, timeout=_PROBE_TIMEOUT_S):
            return "alive"
    except (KeyError, ValueError):
        return "unknown"
    except OSError:
        return "gone"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        view = view[written:]


def _check_address(address: Any) -> str:
    if not isinstance(address, str) or not address.strip():
        raise LaunchTypeError(
            f"ray_address must be the address of a Ray cluster such as 'ray://10.0.0.1:10001' "
            f"or 'auto'; got {address!r}."
        )
    return address.strip()


ADDRESS = BackendOption(
    "ray_address",
    "the Ray cluster to run on (default: RAY_ADDRESS, else a local cluster started for the "
    "launch and shut down after it)",
    check=_check_address,
    metavar="ADDRESS",
)


class RayBackend(Backend):
    name = "ray"
    accelerators = ("cpu", "cuda")
    description = "a Ray cluster"
    options = (ADDRESS,)

    def check(self, plan: LaunchPlan) -> None:
        if plan.num_nodes != 1 or plan.rdzv_endpoint:
            raise LaunchUnsupportedError(
                f"backend='ray' with num_nodes={plan.num_nodes}: Ray places the ranks on its "
                "cluster's machines itself. Leave num_nodes, node_rank and rdzv_* at their "
                "defaults, and give num_processes the total number of ranks."
            )

    def prepare_payload(self, plan: LaunchPlan, payload: tuple[Any, ...]) -> Any:
        function, args, kwargs = payload
        return dump_payload(function, args, kwargs)  # actors are fresh interpreters

    def start(
        self,
        plan: LaunchPlan,
        specs: Sequence[RankSpec],
        ends: Sequence[RankEnds],
        payload: Any,
        target: RankTarget,
    ) -> Started:
        with _connecting:
            ray, shares_cluster = _connect(plan)
        try:
            return _RayStarted(
                _start_actors(ray, plan, specs, ends, payload, target), shares_cluster
            )
        except BaseException:
            if shares_cluster:
                _local_cluster.leave()
            raise


class _RayStarted(Started):
    """One launch's actors, and its share of the local cluster where one was started."""

    def __init__(self, controls: list[ActorControl], shares_cluster: bool) -> None:
        super().__init__(controls)
        self._actors = controls
        self._shares_cluster = shares_cluster

    def close(self) -> None:
        for control in self._actors:
            control.release()
        if self._shares_cluster:
            self._shares_cluster = False
            _local_cluster.leave()


def _start_actors(
    ray: Any,
    plan: LaunchPlan,
    specs: Sequence[RankSpec],
    ends: Sequence[RankEnds],
    payload: Any,
    target: RankTarget,
) -> list[ActorControl]:
    _check_cluster_can_hold(ray, plan, len(specs))
    actor_class = ray.remote(RankHost).options(
        num_cpus=1,
        num_gpus=1 if plan.accelerator == "cuda" else 0,
        max_concurrency=4,  # read() waits while signal() must still get through
        max_restarts=0,
    )
    controls: list[ActorControl] = []
    try:
        for rank_ends in ends:
            controls.append(ActorControl(ray, actor_class.remote(), rank_ends))
        placed = [control._actor.where.remote() for control in controls]
        # The cluster can hold them all (checked above): what is missing is held by
        # other work, which may end; the launch's own timeout= bounds the wait too.
        wait_s = min(_PLACE_TIMEOUT_S, plan.timeout or _PLACE_TIMEOUT_S)
        _, pending = ray.wait(placed, num_returns=len(placed), timeout=wait_s)
        if pending:
            total, free = ray.cluster_resources(), ray.available_resources()
            raise RayClusterError(
                f"Ray could not place {len(pending)} of {len(specs)} ranks within "
                f"{wait_s:g}s: each needs {_needs(plan)}; the cluster has "
                f"{total.get('CPU', 0):g} CPU(s) in all and {free.get('CPU', 0):g} free now, "
                "the rest held by other work or by this launch's ranks placed so far. Wait "
                "for that work to end, ask for fewer ranks, or add machines to the cluster."
            )
        for control, spec, where in zip(controls, specs, placed):
            control.node = Node(*_started(ray, where, control, spec.rank))
        started = [
            control._actor.start.remote(spec, payload, target)
            for control, spec in zip(controls, specs)
        ]
        for control, spec, pid in zip(controls, specs, started):
            _started(ray, pid, control, spec.rank)  # a rank that could not even start raises here
        for control in controls:
            control.begin()  # the rank's pid arrives with its Hello (it may be remote)
    except BaseException:
        for control in controls:
            control.release()
        raise
    return controls


class _LocalCluster:
    """The local cluster a launch started, shared by the launches that overlap it: shut
    down when the last of them closes. Ray holds one connection per process (``ray.init``),
    so this is one per process too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0

    def started(self) -> None:
        with self._lock:
            self._users = 1

    def join(self) -> bool:
        """Whether the cluster this process is connected to is ours: then one more uses it."""
        with self._lock:
            if self._users:
                self._users += 1
            return bool(self._users)

    def leave(self) -> None:
        with self._lock:  # held through the shutdown: no launch joins a cluster going away
            if not self._users:
                return
            self._users -= 1
            if not self._users:
                _shutdown()


_local_cluster = _LocalCluster()
_connecting = threading.Lock()  # one ray.init at a time, for launches started at once


def _started(ray: Any, ref: Any, control: ActorControl, rank: int) -> Any:
    """The value of a call the start made on a rank's actor; an actor that died on the way
    fails the launch, naming the rank and its node."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as error:
        raise RayClusterError(
            f"rank {rank} could not start: {control.loss()}. Launch again once the cluster is "
            "whole (`ray status` lists its nodes)."
        ) from error


def _needs(plan: LaunchPlan) -> str:
    return "1 CPU and 1 GPU" if plan.accelerator == "cuda" else "1 CPU"


def _check_cluster_can_hold(ray: Any, plan: LaunchPlan, ranks: int) -> None:
    """Refuse at once what the whole cluster could never place, however long it waited."""
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)
    fit = int(min(cpus, gpus) if plan.accelerator == "cuda" else cpus)
    if ranks <= fit:
        return
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    raise RayClusterError(
        f"Ray cannot place {ranks} ranks: each needs {_needs(plan)}, and the cluster has "
        f"{cpus:g} CPU(s) and {gpus:g} GPU(s) in all, on {nodes} node(s). Ask for at most "
        f"{fit} rank(s), or add machines to the cluster."
    )


def _connect(plan: LaunchPlan) -> tuple[Any, bool]:
    """Ray, initialised: to ``ray_address`` / RAY_ADDRESS, else a local cluster we start;
    and whether the launch shares the local cluster a launch started (then it leaves it)."""
    try:
        with _start_wait():
            import ray
    except ModuleNotFoundError as error:
        raise LaunchUnsupportedError(
            "backend='ray' needs the package 'ray', which is not installed: "
            "pip install 'notebook-launcher[ray]'."
        ) from error
    if ray.is_initialized():
        return ray, _local_cluster.join()
    address = plan.backend_options.get(ADDRESS.name) or os.environ.get("RAY_ADDRESS")
    # Ray otherwise forwards every worker's output to this kernel, unprefixed; ranks'
    # output reaches the cell through the launcher instead.
    options: dict[str, Any] = {
        "log_to_driver": False,
        "include_dashboard": False,
        "logging_level": logging.WARNING,
    }
    try:
        if address:
            ray.init(address=address, **options)
            return ray, False
        else:
            from notebook_launcher.hardware import available_cpu_count

            cores = available_cpu_count()
            if plan.num_processes > cores:
                print(
                    f"notebook_launcher: the local Ray cluster started for this launch counts "
                    f"{plan.num_processes} CPUs for {plan.num_processes} ranks, but this machine "
                    f"has {cores} core(s): the ranks share them.",
                    file=sys.stderr,
                )
            # Ray binds loopback alone only for the node address 127.0.0.1 itself.
            node_ip = "127.0.0.1" if _is_loopback(plan.master_addr) else None
            with _start_wait():
                ray_local.start(ray, max(cores, plan.num_processes), node_ip, options)
            _local_cluster.started()
            return ray, True
    except Exception as error:
        # A start that failed half way leaves Ray's own processes (gcs_server, raylet)
        # behind unless it is shut down.
        with contextlib.suppress(Exception):
            ray.shutdown()
        if address:
            raise RayClusterError(
                f"could not connect to the Ray cluster at {address!r}: {error}. Check ray_address "
                "(or RAY_ADDRESS). A cluster with token authentication also needs RAY_AUTH_MODE=token "
                "and its token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) in this "
                "kernel's environment. Or leave both unset to start a local cluster for the launch."
            ) from error
        # Where Ray keeps them: RAY_TMPDIR, else TMPDIR, else /tmp, then ray/session_latest.
        base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
        logs = os.path.join(base, "ray", "session_latest", "logs")
        why = str(error).rstrip(". ")
        raise RayClusterError(
            f"could not start a local Ray cluster for the launch: {why}. Ray's logs in {logs} "
            "(raylet.out, gcs_server.out) say why. Run the launch again, or start a cluster "
            "yourself (ray start --head) and pass ray_address=."
        ) from error


@contextlib.contextmanager
def _start_wait() -> Iterator[None]:
    """A generous node start wait for the local cluster, unless the user chose one; the
    kernel's environment is left as it was."""
    if _START_WAIT_ENV in os.environ:
        yield
        return
    os.environ[_START_WAIT_ENV] = _START_WAIT_S
    try:
        yield
    finally:
        os.environ.pop(_START_WAIT_ENV, None)


def _shutdown() -> None:
    import ray

    ray_local.shutdown(ray)


def _is_loopback(address: str) -> bool:
    return address in ("localhost", "::1") or address.startswith("127.")


BACKEND = RayBackend()
