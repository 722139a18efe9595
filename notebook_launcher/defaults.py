"""The user's launch defaults: one JSON file in the Jupyter config directory.

This module alone knows where the file lives and what it holds. The JupyterLab sidebar
(through the server extension) and the kernel-side ``configure()`` panel write it; the
launcher reads it each time ``notebook_launcher()`` runs (never at import), so a default
saved in the sidebar applies to the next launch without restarting the kernel.

The file is small and meant to be readable by hand::

    {"num_processes": 2, "mixed_precision": "bf16", "start_method": "fork"}

A key that is absent or null means "let the launcher decide". Above the file sits a
kernel-level layer that ``configure()`` sets for the running kernel only; a launch takes
each field from that layer, else from the file, and knows which one it used, so a refused
value names where it came from. The vocabulary and the limits are those of
:mod:`notebook_launcher.rules`; this module never imports the launcher.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import stat
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from notebook_launcher import rules
from notebook_launcher.errors import DefaultsError
from notebook_launcher.rules import PRECISIONS, START_METHODS

if TYPE_CHECKING:
    from notebook_launcher.hardware import HardwareReport

__all__ = [
    "FILE",
    "KERNEL",
    "DefaultsError",
    "DefaultsFileWarning",
    "EffectiveDefaults",
    "LaunchDefaults",
    "check_against_hardware",
    "choices",
    "defaults_path",
    "describe_launch",
    "effective_defaults",
    "kernel_defaults",
    "load_defaults",
    "parse_defaults",
    "save_defaults",
    "set_kernel_defaults",
]

_KEYS = ("num_processes", "mixed_precision", "start_method")
# A defaults file is three short keys; anything much bigger is not one (e.g. /dev/zero).
MAX_FILE_BYTES = 64 * 1024
# Where a default came from, as EffectiveDefaults.sources says it.
KERNEL = "kernel"
FILE = "file"


class DefaultsFileWarning(UserWarning):
    """The defaults file exists but cannot be used; the built-in defaults apply instead."""


@dataclasses.dataclass(frozen=True)
class LaunchDefaults:
    """What ``notebook_launcher()`` uses for arguments the call leaves out (None: decide)."""

    num_processes: int | None = None
    mixed_precision: str | None = None  # "no" | "fp16" | "bf16" | "fp8"
    start_method: str | None = None  # "auto" | "fork" | "forkserver" | "spawn"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def defaults_path() -> Path:
    """``<Jupyter config dir>/notebook_launcher/defaults.json`` (honours JUPYTER_CONFIG_DIR)."""
    from jupyter_core.paths import jupyter_config_dir

    return Path(jupyter_config_dir()) / "notebook_launcher" / "defaults.json"


def parse_defaults(data: Mapping[str, object]) -> LaunchDefaults:
    """Check a mapping (a parsed file or a request body) and build the defaults from it."""
    if not isinstance(data, Mapping):
        raise DefaultsError(
            f"Launch defaults must be a JSON object such as "
            f'{{"num_processes": 2}}, got {type(data).__name__}: {data!r}.'
        )
    unknown = [key for key in data if key not in _KEYS]
    if unknown:
        raise DefaultsError(
            f"Unknown launch default {unknown[0]!r}; the known ones are {', '.join(_KEYS)}."
        )
    return LaunchDefaults(
        num_processes=_parse_num_processes(data.get("num_processes")),
        mixed_precision=_parse_choice("mixed_precision", data.get("mixed_precision"), PRECISIONS),
        start_method=_parse_choice("start_method", data.get("start_method"), START_METHODS),
    )


def _parse_num_processes(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DefaultsError(
            f"num_processes must be a whole number of at least 1 (or null to use every "
            f"device), got {value!r}."
        )
    return value


def _parse_choice(key: str, value: object, allowed: tuple[str, ...]) -> str | None:
    if value is None:
        return None
    # Spelled as the launcher accepts it ("BF16" too), stored as the launcher names it.
    if not isinstance(value, str) or rules.canonical(value) not in allowed:
        options = ", ".join(repr(a) for a in allowed)
        raise DefaultsError(f"{key} must be one of {options} (or null to decide), got {value!r}.")
    return str(rules.canonical(value))


def check_against_hardware(defaults: LaunchDefaults, report: HardwareReport) -> None:
    """Refuse defaults this machine cannot run, with the rules the launcher applies (DefaultsError)."""
    if defaults.mixed_precision is not None:
        reason = rules.precision_support(report).get(defaults.mixed_precision)
        if reason is not None:
            raise DefaultsError(
                f"mixed_precision={defaults.mixed_precision!r} cannot run here: {reason}."
            )
    if defaults.num_processes is not None:
        problem = rules.num_processes_problem(defaults.num_processes, report)
        if problem is not None:
            raise DefaultsError(f"{problem}.")
    if defaults.start_method is not None:
        reason = rules.start_method_support().get(defaults.start_method)
        if reason is not None:
            raise DefaultsError(
                f"start_method={defaults.start_method!r} cannot run here: {reason}."
            )


def choices(report: HardwareReport) -> dict[str, Any]:
    """What a panel offers (see :func:`notebook_launcher.rules.choices`)."""
    return rules.choices(report)


def load_defaults(path: Path | None = None) -> LaunchDefaults:
    """The saved defaults; none saved gives ``LaunchDefaults()``, a broken file a warning too.

    Only a regular file of at most MAX_FILE_BYTES is read, without blocking: a FIFO, a
    device or a huge file in its place must not freeze the kernel or the Jupyter server.
    """
    path = defaults_path() if path is None else path
    try:
        raw = _read_small_regular_file(path)
    except FileNotFoundError:
        return LaunchDefaults()
    except _NotADefaultsFile as e:
        _warn_ignored(path, str(e))
        return LaunchDefaults()
    except OSError as e:
        _warn_ignored(path, f"it cannot be read ({e.strerror or e})")
        return LaunchDefaults()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _warn_ignored(
            path, f"it is not UTF-8 text (byte {e.start} is {raw[e.start : e.start + 1]!r})"
        )
        return LaunchDefaults()
    try:
        data = json.loads(text)
    except RecursionError:
        _warn_ignored(path, "it is not valid JSON (nested too deeply)")
        return LaunchDefaults()
    except ValueError as e:
        _warn_ignored(path, f"it is not valid JSON ({e})")
        return LaunchDefaults()
    try:
        return parse_defaults(data)
    except DefaultsError as e:
        _warn_ignored(path, str(e))
        return LaunchDefaults()


class _NotADefaultsFile(Exception):
    """What lies at the defaults path is not a small regular file."""


def _read_small_regular_file(path: Path) -> bytes:
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket, or a FIFO some platforms refuse to open so
            raise _NotADefaultsFile("it is not a regular file") from e
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _NotADefaultsFile(f"it is not a regular file but {_file_kind(info.st_mode)}")
        if info.st_size > MAX_FILE_BYTES:
            raise _NotADefaultsFile(
                f"it is {info.st_size} bytes, more than a defaults file can be ({MAX_FILE_BYTES})"
            )
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_FILE_BYTES:  # it may grow while being read
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_FILE_BYTES:
            raise _NotADefaultsFile(
                f"it is more than {MAX_FILE_BYTES} bytes, more than a defaults file can be"
            )
        return b"".join(chunks)
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    kinds = [
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ]
    return next((word for test, word in kinds if test(mode)), "a special file")


# The kernel-level layer ------------------------------------------------------------

_kernel_defaults: LaunchDefaults | None = None


def set_kernel_defaults(defaults: LaunchDefaults | None) -> None:
    """Make ``defaults`` apply to every later launch of this kernel (None: forget them).

    Fields left None fall through to the saved file. Nothing is written to disk.
    """
    if defaults is not None and not isinstance(defaults, LaunchDefaults):
        raise DefaultsError(
            f"set_kernel_defaults() takes a LaunchDefaults or None; got {type(defaults).__name__} "
            f"{defaults!r}. Build one with LaunchDefaults(num_processes=..., ...)."
        )
    global _kernel_defaults
    _kernel_defaults = defaults


def kernel_defaults() -> LaunchDefaults | None:
    """What ``configure()`` chose in this kernel, if anything."""
    return _kernel_defaults


@dataclasses.dataclass(frozen=True)
class EffectiveDefaults:
    """The defaults a launch uses now, with where each field's value came from."""

    values: LaunchDefaults
    sources: Mapping[str, str]  # field -> KERNEL or FILE; absent: nobody chose it
    path: Path

    def source_of(self, field: str) -> str | None:
        return self.sources.get(field)

    def blame(self, field: str) -> str | None:
        """The sentence that says where a refused value of ``field`` came from, if from here."""
        source = self.sources.get(field)
        if source == KERNEL:
            return (
                "The value came from configure() in this kernel: pass the argument explicitly, "
                "or choose another value in configure()."
            )
        if source == FILE:
            return (
                f"The value came from your saved launch defaults ({self.path}): pass the argument "
                "explicitly, or change the defaults in the JupyterLab sidebar or configure()."
            )
        return None


def effective_defaults() -> EffectiveDefaults:
    """This kernel's configure() choices over the saved file, read now (never cached)."""
    path = defaults_path()
    saved = load_defaults(path)
    kernel = _kernel_defaults or LaunchDefaults()
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in _KEYS:
        mine, filed = getattr(kernel, key), getattr(saved, key)
        if mine is not None:
            values[key], sources[key] = mine, KERNEL
        elif filed is not None:
            values[key], sources[key] = filed, FILE
    return EffectiveDefaults(LaunchDefaults(**values), sources, path)


def _warn_ignored(path: Path, problem: str) -> None:
    warnings.warn(
        f"Ignoring the launch defaults file {path}: {problem.rstrip('.')}. "
        f"notebook_launcher() uses its built-in defaults until you save new defaults "
        f"(JupyterLab's Distributed sidebar or configure()) or fix or delete that file.",
        DefaultsFileWarning,
        stacklevel=3,
    )


def save_defaults(defaults: LaunchDefaults) -> Path:
    """Write the defaults atomically: a crash mid-write leaves the previous file intact."""
    path = defaults_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = json.dumps(defaults.to_dict(), indent=2) + "\n"
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as tmp:
            tmp.write(payload)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_directory(path.parent)
    return path


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable; not every platform lets a directory be opened.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def describe_launch(defaults: LaunchDefaults, report: HardwareReport) -> str:
    """One line saying what ``notebook_launcher()`` with no arguments will now do."""
    count = defaults.num_processes or rules.default_num_processes(report)
    device = rules.DEVICE_WORDS.get(report.accelerator, report.accelerator.upper())
    ranks = f"{count} x {device} rank{'s' if count != 1 else ''}"
    precision = defaults.mixed_precision or "no"
    precision_words = "fp32 (no mixed precision)" if precision == "no" else precision
    method = defaults.start_method or "auto"
    method_words = "start method chosen automatically" if method == "auto" else method
    return f"{ranks}, {precision_words}, {method_words}"
