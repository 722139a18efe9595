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
"""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
import signal
import sys
from collections.abc import Iterator
from typing import Any

_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
_SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

_RAY_PROGRAMS = (b"raylet", b"gcs_server")  # what ray.init starts as children of this process
_saved_auth: dict[str, str | None] | None = None  # the kernel's own settings while a cluster runs


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
        with _single_node(node_ip_address is not None):
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


def _ray_children(ray: Any) -> set[int]:
    """This process's children that run Ray's own programs (read from /proc, where there is one)."""
    package = os.path.dirname(ray.__file__).encode()
    found: set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                name, _, rest = stat.read().partition(b" (")[2].rpartition(b")")
                fields = rest.split()  # after "pid (name)"
            if int(fields[1]) != os.getpid():
                continue
            # A Ray program that died while starting is a zombie with no command line left,
            # known by its name alone, and must still be reaped.
            if fields[0] == b"Z" and name in _RAY_PROGRAMS:
                found.add(int(entry))
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if package in cmdline.read():
                    found.add(int(entry))
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
