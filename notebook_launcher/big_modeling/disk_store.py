"""The offload folder: weights sent to disk, one file per block, laid out so that a whole
block comes back in one read; its descriptors are owned, closed, and its files removed when
the load that wrote them fails."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from notebook_launcher.big_modeling.sizes import nbytes
from notebook_launcher.errors import OffloadFolderError

_ALIGN = 64  # every tensor starts on a 64-byte boundary, so a byte buffer views as any dtype
INDEX = "offload-index.json"


@dataclass
class Placed:
    """Where one offloaded tensor lies in its block's file."""

    file: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


def check_writable(folder: str | os.PathLike[str] | None, needed_by: str) -> tuple[Path, bool]:
    """The folder, created if needed, and whether it was created here."""
    if folder is None:
        raise OffloadFolderError(
            f"{needed_by} sends weights to the disk, and no offload_folder was given; pass "
            "offload_folder='some/folder' (it is created), or raise max_memory so that "
            "everything fits in memory."
        )
    path = Path(folder)
    made = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as e:
        raise OffloadFolderError(
            f"offload_folder={os.fspath(path)!r} cannot be written ({e.strerror or e}); pass a "
            "folder this process may create files in, on a disk with room for the offloaded weights."
        ) from e
    return path, made


_MADV_POPULATE_READ = 22  # Linux 5.14; mmap has no name for it before Python 3.13
_can_populate = True
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _populate(address: int, length: int) -> None:
    """Enter a mapped range's pages into the page table. Through ctypes, which lets the GIL
    go during the call (mmap.madvise holds it), so the model's own thread runs meanwhile."""
    global _can_populate
    if _can_populate and _libc.madvise(address, length, _MADV_POPULATE_READ) == 0:
        return
    _can_populate = False  # an older kernel: ask for read-ahead only
    _libc.madvise(address, length, mmap.MADV_WILLNEED)


class DiskStore:
    """Offloaded weights in ``folder``: one file per block, tensors back to back."""

    def __init__(self, folder: Path, made_folder: bool = False) -> None:
        self.folder = folder
        self.placed: dict[str, Placed] = {}
        self.file_sizes: dict[str, int] = {}
        self.written: set[str] = set()
        self.created: list[Path] = []  # files this store made: removed if the load fails
        self._made_folder = made_folder
        self._write_fds: dict[str, int] = {}
        self._read_fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def plan(self, block: str, tensors: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        """Reserve room for a block's tensors (name, shape, dtype) in a file of its own."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", block or "model")[:80]
        file = f"{len(self.file_sizes):05d}-{safe}.bin"
        offset = 0
        for name, shape, dtype in tensors:
            self.placed[name] = Placed(file, offset, shape, dtype)
            offset += -(-nbytes(shape, dtype) // _ALIGN) * _ALIGN
        self.file_sizes[file] = offset
        path = self.folder / file
        try:
            if not path.exists():
                self.created.append(path)
            with open(path, "wb") as f:
                f.truncate(offset)
        except OSError as e:
            raise OffloadFolderError(
                f"offload_folder={os.fspath(self.folder)!r}: cannot create {file!r} ({e.strerror or e}); "
                "free some room or pass another folder."
            ) from e

    def write(self, name: str, tensor: torch.Tensor) -> None:
        place = self.placed[name]
        data = tensor.detach().to("cpu", place.dtype).contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""  # 0-dim too
        fd = self._fd(place.file, write=True)
        written = os.pwrite(fd, cast(Any, raw) if len(raw) else b"", place.offset)
        if written != place.nbytes:
            raise OffloadFolderError(
                f"offload_folder={os.fspath(self.folder)!r}: wrote {written} of {place.nbytes} "
                f"bytes of {name!r}; the disk may be full."
            )
        self.written.add(name)

    def finish_writing(self) -> None:
        """Close the files being written and record the layout beside them."""
        with self._lock:
            for fd in self._write_fds.values():
                os.close(fd)
            self._write_fds.clear()
        index = {
            name: {
                "file": p.file,
                "offset": p.offset,
                "shape": list(p.shape),
                "dtype": str(p.dtype),
            }
            for name, p in self.placed.items()
        }
        if not (self.folder / INDEX).exists():
            self.created.append(self.folder / INDEX)
        with open(self.folder / INDEX, "w") as f:
            json.dump(index, f, indent=1)

    def adopt(self, wanted: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Take as written the weights of ``wanted`` (name -> shape, dtype) that the folder's
        index lists with that shape and dtype: what an earlier load wrote there."""
        try:
            with open(self.folder / INDEX) as f:
                index = json.load(f)
        except (OSError, ValueError):
            return
        for name, (shape, dtype) in wanted.items():
            entry = index.get(name) if isinstance(index, dict) else None
            if (
                not isinstance(entry, dict)
                or tuple(entry.get("shape", ())) != shape
                or entry.get("dtype") != str(dtype)
                or not (self.folder / str(entry.get("file"))).is_file()
            ):
                continue
            self.placed[name] = Placed(str(entry["file"]), int(entry["offset"]), shape, dtype)
            self.written.add(name)

    def abort(self) -> None:
        """Close every descriptor and remove what this store wrote (a load failed)."""
        self.close()
        for path in reversed(self.created):
            path.unlink(missing_ok=True)
        self.created.clear()
        if self._made_folder:
            try:
                self.folder.rmdir()
            except OSError:
                pass  # something else was put there meanwhile

    def _fd(self, file: str, write: bool) -> int:
        # Shared by the prefetch thread and the caller; pread/pwrite need no shared position.
        with self._lock:
            fds = self._write_fds if write else self._read_fds
            if file not in fds:
                fds[file] = os.open(self.folder / file, os.O_RDWR if write else os.O_RDONLY)
            return fds[file]

    def read(
        self,
        names: list[str],
        pin: bool = False,
        buffer_for: Callable[[int], torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The tensors ``names``: whole files read in one call where a block owns them all.

        ``buffer_for(nbytes)`` may hand out a reused byte buffer to read into: fresh memory
        costs a page fault per page, every time.
        """
        out: dict[str, torch.Tensor] = {}
        for file, wanted, start, end in self._spans(names):
            if buffer_for is not None:
                buffer = buffer_for(end - start)[: end - start]
            else:
                buffer = torch.empty(end - start, dtype=torch.uint8, pin_memory=pin)
            fd = self._fd(file, write=False)
            view = memoryview(cast(Any, buffer.numpy()))
            got = 0
            while got < len(view):
                count = os.preadv(fd, [view[got:]], start + got)
                if count <= 0:
                    raise self._shorter(file)
                got += count
            out.update(self._views(buffer, start, wanted))
        return out

    def map(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` as views of a private memory map of their file: no copy.

        Each call maps afresh, and the map is undone when the last view of it is let go, so
        a view an output keeps stays valid and is never overwritten. The file's pages are
        entered into the page table here (the side thread), so that the block using them
        does not stop at each page.
        """
        out: dict[str, torch.Tensor] = {}
        for file, wanted, start, end in self._spans(names):
            start -= start % mmap.ALLOCATIONGRANULARITY  # where a map may begin
            if end == start:
                out.update(self._views(torch.empty(0, dtype=torch.uint8), start, wanted))
                continue
            fd = self._fd(file, write=False)
            if os.fstat(fd).st_size < end:  # reading past its end would kill the process
                raise self._shorter(file)
            # Private and writable: an in-place write to a weight copies its page, and never
            # reaches the file or the next forward.
            mapped = mmap.mmap(
                fd,
                end - start,
                flags=mmap.MAP_PRIVATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=start,
            )
            whole = torch.frombuffer(mapped, dtype=torch.uint8)  # keeps the map alive
            _populate(whole.data_ptr(), end - start)
            out.update(self._views(whole, start, wanted))
        return out

    def _spans(self, names: list[str]) -> list[tuple[str, list[str], int, int]]:
        """(file, the names in it, first byte, end) for each file holding some of ``names``."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.placed[name].file, []).append(name)
        return [
            (
                file,
                wanted,
                min(self.placed[n].offset for n in wanted),
                max(self.placed[n].offset + self.placed[n].nbytes for n in wanted),
            )
            for file, wanted in by_file.items()
        ]

    def _views(self, data: torch.Tensor, start: int, wanted: list[str]) -> dict[str, torch.Tensor]:
        """Each tensor of ``wanted`` as a view of ``data``, the file's bytes from ``start``."""
        out: dict[str, torch.Tensor] = {}
        for name in wanted:
            place = self.placed[name]
            piece = data[place.offset - start : place.offset - start + place.nbytes]
            out[name] = (
                piece.view(place.dtype).view(place.shape)
                if place.nbytes
                else torch.empty(place.shape, dtype=place.dtype)
            )
        return out

    def _shorter(self, file: str) -> OffloadFolderError:
        return OffloadFolderError(
            f"offload file {os.fspath(self.folder / file)!r} is shorter than expected; "
            "it was changed or removed while the model used it. Load the model again."
        )

    def close(self) -> None:
        with self._lock:
            for fd in (*self._write_fds.values(), *self._read_fds.values()):
                os.close(fd)
            self._write_fds.clear()
            self._read_fds.clear()
