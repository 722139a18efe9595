"""A view of a rendezvous store that only holders of a launch's or session's secret can use.

torch's TCPStore has no authentication, and anyone who can reach its port can list, read
and write its keys (``list_keys`` included); gloo then trusts the peer addresses it reads
there. Through this view every key name is an HMAC of the secret, the process group's
generation and the key, so names reveal nothing and the next generation's names cannot be
guessed; every value is encrypted and authenticated with the secret, so a stranger reads
nothing and a value it wrote is refused instead of trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_NONCE_BYTES = 16
_TAG_BYTES = 32


class ForgedStoreValue(RuntimeError):
    """A store value that was not written by a process holding the secret."""


class SealedStore(dist.Store):
    """Keys and values of ``inner`` sealed with ``secret``, scoped to one ``generation``."""

    def __init__(self, inner: Any, secret: bytes, generation: int) -> None:
        super().__init__()
        self._inner = inner
        self._name_key = hmac.new(secret, f"names/{generation}".encode(), hashlib.sha256).digest()
        self._value_key = hmac.new(secret, f"values/{generation}".encode(), hashlib.sha256).digest()

    def _name(self, key: str) -> str:
        return hmac.new(self._name_key, key.encode(), hashlib.sha256).hexdigest()

    def _seal(self, name: str, value: bytes) -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        body = _xor(value, self._stream(name, nonce, len(value)))
        return nonce + body + self._tag(name, nonce, body)

    def _open(self, name: str, sealed: bytes) -> bytes:
        nonce, body, tag = (
            sealed[:_NONCE_BYTES],
            sealed[_NONCE_BYTES:-_TAG_BYTES],
            sealed[-_TAG_BYTES:],
        )
        if len(sealed) < _NONCE_BYTES + _TAG_BYTES or not hmac.compare_digest(
            tag, self._tag(name, nonce, body)
        ):
            raise ForgedStoreValue(
                "a rendezvous store value failed its check: a process without the secret of "
                "this launch or session wrote it. Another program on this machine is writing to the store's "
                "port; the value was refused, not trusted."
            )
        return _xor(body, self._stream(name, nonce, len(body)))

    def _stream(self, name: str, nonce: bytes, size: int) -> bytes:
        return hashlib.shake_256(self._value_key + name.encode() + nonce).digest(size)

    def _tag(self, name: str, nonce: bytes, body: bytes) -> bytes:
        return hmac.new(self._value_key, name.encode() + nonce + body, hashlib.sha256).digest()

    # The Store interface (what gloo, nccl and init_process_group call) -----------------

    def set(self, key: str, value: Any) -> None:
        name = self._name(key)
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(name, self._seal(name, data))

    def get(self, key: str) -> bytes:
        name = self._name(key)
        return self._open(name, bytes(self._inner.get(name)))

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(self._name(key), amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        # Sealed values differ on every write, so only "set if absent" keeps its meaning.
        name = self._name(key)
        current = self._inner.compare_set(name, b"", self._seal(name, _bytes(desired)))
        return self._open(name, bytes(current)) if current else _bytes(desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self._name(key) for key in keys]
        if timeout is None:
            self._inner.wait(names)
        else:
            self._inner.wait(names, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check([self._name(key) for key in keys]))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(self._name(key)))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _xor(data: bytes, stream: bytes) -> bytes:
    return (int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")).to_bytes(
        len(data), "little"
    )
