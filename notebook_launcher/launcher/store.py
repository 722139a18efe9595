"""The rendezvous store, hosted by the launching kernel for the length of one launch.

Ranks connect to it as torchrun's ranks connect to their agent's store
(``TORCHELASTIC_USE_AGENT_STORE``). Holding it here means the port is bound before any
rank starts (no race for a "free" port, no "address in use" on a quick re-run), it
listens on the given address only (loopback by default), and it is gone with the launch.

torch's TCPStore has no authentication: any process that reaches the port may read and
write any key it can name. So every key of a launch lives under a per-launch secret
(:func:`new_secret`): the kernel hands the secret to its ranks with their other settings
(never on the command line), and each rank reaches the store only through
:func:`protect_env_rendezvous`, which puts the secret in front of every key torch's
``env://`` rendezvous and the process group use. A process without the secret can
connect, but every key it can name is outside the launch's keys: it can neither read the
ranks' addresses nor write a key the launch reads.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import secrets
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from notebook_launcher.errors import LaunchConfigError

# The environment variable through which a rank receives its launch's store secret.
SECRET_ENV = "NOTEBOOK_LAUNCHER_STORE_SECRET"


class PortInUseError(LaunchConfigError):
    """The port a store must listen on is held by another process."""


def bind_listener(address: str, port: int | None, *, source: str = "use_port") -> socket.socket:
    """A listening socket on ``address``: ``port`` if given, else one the OS picks.

    ``source`` names the argument the port came from (``use_port=29500``,
    ``rdzv_endpoint='127.0.0.1:29500'``), so that the message speaks of what the user
    wrote.
    """
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
            where = f"use_port={port}" if source == "use_port" else source
            fix = (
                "Leave use_port unset to get a free port, or pick another one."
                if source == "use_port"
                else "Pick a free port for it, or end the program that holds this one "
                "(`ss -ltnp` names it)."
            )
            raise PortInUseError(
                f"{where}: port {port} on {address} is already in use by another process. {fix}"
            ) from error
        raise LaunchConfigError(
            f"cannot listen on {address}:{port or 0} for the rendezvous store: {error}. "
            "Check master_addr: it must be an address of this machine."
        ) from error
    return listener


def new_secret() -> str:
    """A fresh secret for one launch (or one session): 128 random bits."""
    return secrets.token_hex(16)


def derived_secret(*parts: str) -> str:
    """A secret every machine of a launch computes alike from what they share."""
    return hashlib.sha256("\0".join(("notebook_launcher", *parts)).encode()).hexdigest()[:32]


def secret_prefix(secret: str) -> str:
    return f"nl-{secret}/"


def protected(store: Any, secret: str) -> Any:
    """``store`` with every key under ``secret``: what the launch reads and writes."""
    from torch.distributed import PrefixStore

    return PrefixStore(secret_prefix(secret), store)


_LIVE_STORES: list[Any] = []


def protect_env_rendezvous(secret: str | None) -> None:
    """In a rank: make torch's ``env://`` rendezvous (``init_process_group``'s default)
    use only keys under ``secret``.

    torch allows one handler per scheme and no replacement through its public function,
    so the entry of its table is swapped here; the original handler still connects.
    """
    if not secret:
        return
    # The module, not the function of the same name torch.distributed exports.
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    original = handlers["env"]
    if getattr(original, "_notebook_launcher_secret", None) is not None:
        original = original._notebook_launcher_original

    def secured(
        url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any
    ) -> Iterator[Any]:
        from notebook_launcher.launcher.sealed_store import SealedStore

        store, rank, world_size = next(original(url, timeout=timeout, **kwargs))
        # Sealed, not only prefixed: TCPStore lists its keys to any client (list_keys).
        sealed = SealedStore(store, secret.encode(), generation=0)
        # torch keeps only the C++ half of a Store written in Python; the Python half must
        # live as long as the process group, or its methods become pure virtual calls.
        _LIVE_STORES.append(sealed)
        yield sealed, rank, world_size
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    secured._notebook_launcher_secret = secret  # type: ignore[attr-defined]
    secured._notebook_launcher_original = original  # type: ignore[attr-defined]
    handlers["env"] = secured


# Whether this torch's libuv store takes a bound socket: torch 2.6 refuses one
# (NotImplementedError) where the legacy backend takes it; learnt once per process.
_LIBUV_TAKES_A_SOCKET: list[bool] = []


def store_on_socket(listener: socket.socket, world_size: int | None, timeout: timedelta) -> Any:
    """A TCPStore server listening on ``listener``, which it now owns (and closes)."""
    from torch.distributed import TCPStore

    # Imported here, in the process that starts the ranks (torch is loaded by now): a rank
    # forked from it finds the module loaded when its rendezvous seals the store.
    from notebook_launcher.launcher import sealed_store  # noqa: F401

    host, port = listener.getsockname()[:2]
    fd = listener.detach()

    def start(use_libuv: bool) -> Any:
        return TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
            use_libuv=use_libuv,
        )

    if not _LIBUV_TAKES_A_SOCKET:
        try:
            store = start(use_libuv=True)
        except NotImplementedError:  # the fd is still ours: torch checks before it uses it
            _LIBUV_TAKES_A_SOCKET.append(False)
            return start(use_libuv=False)
        _LIBUV_TAKES_A_SOCKET.append(True)
        return store
    return start(use_libuv=_LIBUV_TAKES_A_SOCKET[0])


class RendezvousStore:
    """A TCPStore server on a socket we bound, closed with :meth:`close`.

    ``secret`` is the launch's: give it to every rank (``SECRET_ENV``), which then uses
    only keys under it.
    """

    def __init__(
        self,
        listener: socket.socket,
        world_size: int,
        secret: str | None = None,
        *,
        serve_now: bool = True,
    ) -> None:
        self.address, self.port = listener.getsockname()[:2]
        self.secret = secret or new_secret()
        self._world_size = world_size
        self._listener: socket.socket | None = listener
        self._store: Any = None
        if serve_now:
            self.serve()

    def serve(self) -> None:
        """Start answering (once). Until then the listening socket queues the ranks'
        connections, so a store started just after the ranks were forked costs them no
        wait, and its server thread is never copied into a forked rank."""
        if self._listener is not None:
            listener, self._listener = self._listener, None
            # The store owns and closes the socket.
            self._store = store_on_socket(listener, self._world_size, timedelta(seconds=300))

    def close(self) -> None:
        if self._listener is not None:  # never served
            self._listener.close()
            self._listener = None
        self._store = None  # the server stops and frees its port when the store is released


# The first bytes of torch's TCPStore protocol: a client validates itself (query 0, the
# magic number) and pings (query 13) with a number the server sends back.
_VALIDATE = bytes([0]) + (0x3C85F7CE).to_bytes(4, "little")
_PING = 13


def probe_store(host: str, port: int, timeout: float = 2.0) -> str:
    """What listens at ``host:port``: ``"store"`` (a TCPStore answered), ``"nothing"``
    (refused, unreachable, or closed without a word: it may come later) or ``"other"`` (a program that does not
    speak the store's protocol, which torch's client would wait on without end).

    Asked in Python, so an absent host costs no C++ stack trace per try.
    """
    nonce = secrets.randbits(31).to_bytes(4, "little")
    try:
        connection = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return "nothing"
    answer = b""
    with connection:
        try:
            connection.settimeout(timeout)
            connection.sendall(_VALIDATE + bytes([_PING]) + nonce)
            while len(answer) < 4:
                chunk = connection.recv(4 - len(answer))
                if not chunk:
                    # Closed before a word: a store closing (the previous launch's, released
                    # by its host meanwhile) does that; it may listen again, so ask again.
                    return "nothing" if not answer else "other"
                answer += chunk
        except (ConnectionResetError, BrokenPipeError):
            if not answer:
                return "nothing"
        except OSError:  # no answer in time: a program that does not speak the protocol
            pass
    return "store" if answer == nonce else "other"
