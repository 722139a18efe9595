"""A session rank's process groups, tracked where they are created, so an interrupt cuts them all.

Gloo has no abort that ends a pending wait: a collective blocked on a peer that will not
come ends only when its connections close. So each group's connections are noted as the
group is made, the default one by the rank and every other one through
``torch.distributed.new_group`` (which ``new_subgroups`` calls too), wrapped here for the
rank's whole life. The note is taken around that one call, so it holds the sockets that
making this group opened. After an interrupt the kernel has every rank rebuild its groups:
the default one, then the cell's own in the order they were made, and names in the rank's
namespace that held an old group are bound to its replacement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import stat
import sys
import threading
from typing import Any, Callable

Socket = tuple[int, int]  # (descriptor, inode): a descriptor closed and reused is not the group's


@dataclasses.dataclass
class _Made:
    """A group the rank's code made, and how to make it again."""

    group: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class GroupTracker:
    """Every process group of this rank with the connections it opened."""

    def __init__(self, dist: Any) -> None:
        self._dist = dist
        self._lock = threading.Lock()  # the side thread cuts while the main thread makes
        self._sockets: dict[int, set[Socket]] = {}  # id(group) -> its connections
        self._default: Any = None
        self._made: list[_Made] = []  # the cells' groups, in the order they were made
        self._original: Callable[..., Any] = dist.new_group
        for module in (dist, dist.distributed_c10d):
            module.new_group = self._new_group

    def init_default(self, **kwargs: Any) -> None:
        """``init_process_group(**kwargs)``, noting the default group's connections."""
        with self._noting() as opened:
            self._dist.init_process_group(**kwargs)
        group = self._dist.distributed_c10d._get_default_group()
        with self._lock:
            self._default = group
            self._sockets[id(group)] = opened

    def _new_group(self, *args: Any, **kwargs: Any) -> Any:
        """torch.distributed.new_group, as the rank's code calls it; its connections noted."""
        with self._noting() as opened:
            group = self._original(*args, **kwargs)
        with self._lock:
            self._made.append(_Made(group, args, kwargs))
            self._sockets[id(group)] = opened
        return group

    @contextlib.contextmanager
    def _noting(self) -> Any:
        before = _tcp_sockets()
        opened: set[Socket] = set()
        yield opened
        opened.update(_tcp_sockets() - before)

    def groups(self) -> list[Any]:
        """The default group and the cells' groups still registered with torch."""
        with self._lock:
            made = [m.group for m in self._made]
        return [self._default, *(g for g in made if self._registered(g))]

    def cut(self) -> None:
        """Close every group's connections (from any thread): a pending wait fails at once."""
        with self._lock:
            sockets = [s for group in self._sockets.values() for s in group]
        for fd, inode in sockets:
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_ino != inode:
                    continue  # closed since, and the descriptor reused: not a group's
                peer = socket.socket(fileno=os.dup(fd))
                try:
                    peer.shutdown(socket.SHUT_RDWR)
                finally:
                    peer.close()

    def abort(self) -> None:
        """NCCL's own way to end pending collectives, on every group."""
        for group in self.groups():
            with contextlib.suppress(Exception):
                group.abort()

    def rebuild(self, init_default: Callable[[], None], namespace: dict[str, Any]) -> None:
        """Destroy every group and make them again (on every rank, in the same order); names in
        ``namespace`` that held an old group now hold its replacement."""
        old_default = self._default
        with self._lock:
            made = [m for m in self._made if self._registered(m.group)]
            self._made, self._sockets = [], {}
        with contextlib.suppress(Exception):
            self._dist.destroy_process_group()
        init_default()
        replacements = {id(old_default): self._default}
        # Every rank must make the same groups in the same order: a rank interrupted before
        # it made a group has one fewer, and the groups are then not made again at all.
        counts: list[Any] = [None] * self._dist.get_world_size()
        self._dist.all_gather_object(counts, len(made))
        if len(set(counts)) == 1:
            for entry in made:
                replacements[id(entry.group)] = self._new_group(*entry.args, **entry.kwargs)
        elif made:
            print(
                f"notebook_launcher: the ranks had made different numbers of process groups "
                f"({', '.join(map(str, counts))}) when the cell was interrupted, so the cell's "
                "own groups were not made again; make them again with new_group.",
                file=sys.stderr,
            )
        for name, value in list(namespace.items()):
            replacement = replacements.get(id(value))
            if replacement is not None:
                namespace[name] = replacement

    def _registered(self, group: Any) -> bool:
        """Not destroyed by the rank's own code (a rank outside the group holds a marker)."""
        world = getattr(self._dist.distributed_c10d, "_world", None)
        if world is None or group is self._dist.GroupMember.NON_GROUP_MEMBER:
            return True
        return group in world.pg_map


def _tcp_sockets() -> set[Socket]:
    """This process's connected TCP sockets, by descriptor and inode."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        with contextlib.suppress(OSError):
            info = os.fstat(fd)
            if not stat.S_ISSOCK(info.st_mode):
                continue
            probe = socket.socket(fileno=os.dup(fd))
            try:
                if (
                    probe.family in (socket.AF_INET, socket.AF_INET6)
                    and probe.type == socket.SOCK_STREAM
                    # Connections only: cutting gloo's listening socket aborts the process.
                    and not probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                ):
                    probe.getpeername()  # raises when not connected
                    found.add((fd, info.st_ino))
            finally:
                probe.close()
    return found
