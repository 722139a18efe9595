"""The rendezvous store, hosted by the launching kernel for the length of one launch.

Ranks connect to it as torchrun's ranks connect to their agent's store
(``TORCHELASTIC_USE_AGENT_STORE``). Holding it here means the port is bound before any
rank starts (no race for a "free" port, no "address in use" on a quick re-run), it
listens on the given address only (loopback by default), and it is gone with the launch.
"""

from __future__ import annotations

import errno
import socket
from datetime import timedelta
from typing import Any

from notebook_launcher.errors import LaunchConfigError


def bind_listener(address: str, port: int | None) -> socket.socket:
    """A listening socket on ``address``: ``port`` if given, else one the OS picks."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    # A port whose previous store just closed lingers in TIME_WAIT; a re-run may take it.
    # (A port some process still listens on stays refused.)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((address, port or 0))
        listener.listen(128)
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRINUSE:
            raise LaunchConfigError(
                f"use_port={port}: port {port} on {address} is already in use by another "
                "process. Leave use_port unset to get a free port, or pick another one."
            ) from error
        raise LaunchConfigError(
            f"cannot listen on {address}:{port or 0} for the rendezvous store: {error}. "
            "Check master_addr: it must be an address of this machine."
        ) from error
    return listener


class RendezvousStore:
    """A TCPStore server on a socket we bound, closed with :meth:`close`."""

    def __init__(self, listener: socket.socket, world_size: int) -> None:
        from torch.distributed import TCPStore

        self.address, self.port = listener.getsockname()[:2]
        self._store: Any = TCPStore(
            self.address,
            self.port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=300),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),  # the store owns and closes the socket
            use_libuv=True,
        )

    def close(self) -> None:
        self._store = None  # the server stops and frees its port when the store is released
