"""The Ray cluster a launch starts for itself (no ``ray_address``): it listens on loopback
only, and admits only clients that hold a token made for it.

Loopback: Ray turns a node address of 127.0.0.1 into the machine's outward one, and then
binds its gcs_server, raylet and workers to every interface, unless multi-node clusters
are switched off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, what Ray does on macOS and
Windows); with the node address left at 127.0.0.1, each of them binds that address alone.
Ray's processes read the switch from the environment they start with; the kernel's Ray
read it when imported, so its copy is switched for the start too, and both are put back.

Token: Ray's token authentication is on whatever ``RAY_AUTH_MODE`` says. The token is
fresh for each cluster and reaches Ray's processes through the environment they start
with (readable by this user alone), never through a file: Ray's default,
``~/.ray/auth_token``, is written readable by every user who can enter the home folder.
The kernel's environment holds the token while the cluster runs and gets its own
settings back when the cluster is shut down.

Start: the raylet is given its agents' ports, so that it need not wait for the agents
(which a busy machine starts slowly) within Ray's fixed 15 s; the start then waits for the
node's registration, and says at once when the raylet exited (node_start_awaited).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
_SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

_RAY_PROGRAMS = (b"raylet", b"gcs_server")  # what ray.init starts as children of this process
_saved_auth: dict[str, str | None] | None = None  # the kernel's own settings while a cluster runs
# The ports a raylet's agents listen on, chosen before the start (node_start_awaited).
_AGENT_PORTS = (
    "metrics_agent_port",
    "metrics_export_port",
    "runtime_env_agent_port",
    "dashboard_agent_listen_port",
)
_POLL_S = 0.2


class RayletExited(Exception):
    """The raylet of the node being started exited before the node registered."""


def start(ray: Any, num_cpus: int, node_ip_address: str | None, options: dict[str, Any]) -> None:
    """``ray.init`` of a new local cluster, with a token of its own, on loopback where
    ``node_ip_address`` is a loopback address. What a failed start changed is put back."""
    global _saved_auth
    saved = {name: os.environ.get(name) for name in _AUTH_ENV}
    if (saved["RAY_AUTH_MODE"] or "").lower() == "disabled":
        print(
            "notebook_launcher: RAY_AUTH_MODE=disabled is set, but the Ray cluster started for "
            "this launch uses token authentication anyway: it is started with a token of its "
            "own, which only the launcher needs. To run a cluster without authentication, "
            "start it yourself (ray start) and pass ray_address=.",
            file=sys.stderr,
        )
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    _reload_auth()
    _saved_auth = saved
    before = _ray_children(ray)
    try:
        with _single_node(node_ip_address is not None), node_start_awaited():
            ray.init(num_cpus=num_cpus, _node_ip_address=node_ip_address, **options)
    except BaseException:
        shutdown(ray)
        # A start that failed before Ray kept hold of its node (its raylet died while
        # starting) leaves the gcs_server and Ray's helpers running: ray.shutdown() does not
        # know them.
        _kill(_ray_children(ray) - before)
        raise


def shutdown(ray: Any) -> None:
    """Shut the cluster down and give the kernel its own authentication settings back."""
    global _saved_auth
    with contextlib.suppress(Exception):
        ray.shutdown()
    if _saved_auth is None:
        return
    for name, value in _saved_auth.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved_auth = None
    _reload_auth()


@contextlib.contextmanager
def node_start_awaited() -> Iterator[None]:
    """While a node starts in this process (``ray.init`` of a new cluster, or Ray's own
    ``Node``): its raylet is given its agents' ports, and the start ends as soon as the
    raylet exits instead of waiting out Ray's bound.

    Ports: a raylet not given them waits for its agents (Python processes importing Ray) to
    write them to files, for a fixed 15 s that no setting reaches, then aborts; a busy
    machine starts the agents slower than that. Given the ports, the raylet registers
    without waiting, and the agents join when they are up.

    Exit: Ray's driver asks the GCS for the node, a question that waits up to
    ``RAY_raylet_start_wait_time_s`` for the raylet to register; one that exited never will.
    """
    try:
        services: Any = importlib.import_module("ray._private.services")
        node_class: Any = importlib.import_module("ray._private.node").Node
    except (ImportError, AttributeError):
        yield
        return
    real_init = node_class.__init__
    real_start_process = services.start_ray_process
    real_get_node = services.get_node
    listen: list[int] = []

    def init(node: Any, *args: Any, **kwargs: Any) -> None:
        params = kwargs["ray_params"] if "ray_params" in kwargs else args[0] if args else None
        # Only where this Ray's parameters are the ones known here; else Ray's own start.
        if params is not None and all(hasattr(params, name) for name in _AGENT_PORTS):
            for name in _AGENT_PORTS:
                setattr(params, name, _free_port())
            listen[:] = [params.dashboard_agent_listen_port]
        real_init(node, *args, **kwargs)

    def start_ray_process(command: list[str], process_type: str, *args: Any, **kwargs: Any) -> Any:
        # Ray's Python code hands the listen port to the agent but not to the raylet.
        if process_type == "raylet" and listen:
            command = [*command, f"--dashboard_agent_listen_port={listen[0]}"]
        return real_start_process(command, process_type, *args, **kwargs)

    def get_node(*args: Any, **kwargs: Any) -> Any:
        return _unless_raylet_exits(real_get_node, *args, **kwargs)

    node_class.__init__ = init
    services.start_ray_process = start_ray_process
    services.get_node = get_node
    try:
        yield
    finally:
        node_class.__init__ = real_init
        services.start_ray_process = real_start_process
        services.get_node = real_get_node


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _unless_raylet_exits(ask: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``ask(*args)``, asked in a thread of its own, unless this process's raylet exits
    first (then RayletExited). The thread, if left, ends with Ray's own bound."""
    answer: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            answer.append(ask(*args, **kwargs))
        except BaseException as error:  # handed to the caller
            failed.append(error)

    asking = threading.Thread(target=run, name="ray-node-registration", daemon=True)
    asking.start()
    while True:
        asking.join(_POLL_S)
        if not asking.is_alive():
            break
        gone = _raylet_gone()
        if gone is not None:
            raise RayletExited(f"Ray's raylet{gone} exited before its node registered with the GCS")
    if failed:
        raise failed[0]
    return answer[0]


def _raylet_gone() -> str | None:
    """None while a raylet child of this process runs; else what is known of it (its pid,
    when it is a zombie not reaped yet, as " (pid N)", or "" when there is none)."""
    children = _children()
    if children is None:
        return None  # no /proc: nothing to tell, and Ray's own bound applies
    for pid, name, state in children:
        if name == b"raylet":
            return f" (pid {pid})" if state in (b"Z", b"X") else None
    return ""


def _ray_children(ray: Any) -> set[int]:
    """This process's children that run Ray's own programs (read from /proc, where there is one)."""
    package = os.path.dirname(ray.__file__).encode()
    found: set[int] = set()
    for pid, name, state in _children() or []:
        # A Ray program that died while starting is a zombie with no command line left,
        # known by its name alone, and must still be reaped.
        if state == b"Z" and name in _RAY_PROGRAMS:
            found.add(pid)
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if package in cmdline.read():
                    found.add(pid)
        except OSError:
            continue
    return found


def _children() -> list[tuple[int, bytes, bytes]] | None:
    """(pid, name, state) of each child of this process, from /proc; None without /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    found = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                name, _, rest = stat.read().partition(b" (")[2].rpartition(b")")
            fields = rest.split()  # after "pid (name)": state, parent, ...
            if int(fields[1]) == os.getpid():
                found.append((int(entry), name, fields[0]))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _kill(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _reload_auth() -> None:
    """Ray caches its authentication mode and token per process: make it read them again."""
    try:
        raylet: Any = importlib.import_module("ray._raylet")
    except ImportError:
        return
    with contextlib.suppress(AttributeError):
        raylet.Config.initialize("")
    with contextlib.suppress(AttributeError):  # Ray releases before token authentication
        raylet.AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def _single_node(loopback: bool) -> Iterator[None]:
    """Ray keeps a loopback node address (and so binds loopback alone) for the start."""
    if not loopback:
        yield
        return
    saved_env = os.environ.get(_SINGLE_NODE_ENV)
    os.environ[_SINGLE_NODE_ENV] = "0"
    constants: Any = None
    with contextlib.suppress(ImportError):
        constants = importlib.import_module("ray._private.ray_constants")
    saved = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    if saved is not None:
        constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if saved is not None:
            constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(_SINGLE_NODE_ENV, None)
        else:
            os.environ[_SINGLE_NODE_ENV] = saved_env
