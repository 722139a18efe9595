"""The user's launch defaults: one JSON file in the Jupyter config directory.

This module alone knows where the file lives and what it holds. The JupyterLab sidebar
(through the server extension) and the kernel-side ``configure()`` panel write it; the
launcher reads it each time ``notebook_launcher()`` runs (never at import), so a default
saved in the sidebar applies to the next launch without restarting the kernel.

The file is small and meant to be readable by hand::

    {"num_processes": 2, "mixed_precision": "bf16", "start_method": "fork"}

A key that is absent or null means "let the launcher decide".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from notebook_launcher.hardware import PRECISIONS, precision_support
from notebook_launcher.launcher.start_method import START_METHODS

if TYPE_CHECKING:
    from notebook_launcher.hardware import HardwareReport

_KEYS = ("num_processes", "mixed_precision", "start_method")
_DEVICE_WORDS = {"cuda": "GPU", "tpu": "TPU", "mps": "MPS", "cpu": "CPU"}


class DefaultsError(ValueError):
    """A launch default that is unknown, malformed, or impossible on this machine."""


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
    if not isinstance(value, str) or value not in allowed:
        options = ", ".join(repr(a) for a in allowed)
        raise DefaultsError(f"{key} must be one of {options} (or null to decide), got {value!r}.")
    return value


def check_against_hardware(defaults: LaunchDefaults, report: HardwareReport) -> None:
    """Refuse defaults this machine cannot run, saying why (DefaultsError)."""
    if defaults.mixed_precision is not None:
        reason = precision_support(report).get(defaults.mixed_precision)
        if reason is not None:
            raise DefaultsError(
                f"mixed_precision={defaults.mixed_precision!r} cannot run here: {reason}."
            )
    limit = max_num_processes(report)
    if defaults.num_processes is not None and limit is not None and defaults.num_processes > limit:
        device = _DEVICE_WORDS.get(report.accelerator, report.accelerator)
        raise DefaultsError(
            f"num_processes={defaults.num_processes} is more than this machine's {limit} "
            f"{device} device(s), and each rank needs its own; choose at most {limit}."
        )
    if defaults.start_method is not None:
        reason = start_method_support().get(defaults.start_method)
        if reason is not None:
            raise DefaultsError(
                f"start_method={defaults.start_method!r} cannot run here: {reason}."
            )


def max_num_processes(report: HardwareReport) -> int | None:
    """The most ranks the machine can run, one per device; None where ranks share CPUs."""
    if report.accelerator == "cuda":
        return len(report.gpus)
    if report.accelerator == "tpu":
        return report.tpu_cores
    if report.accelerator == "mps":
        return 1
    return None


def start_method_support() -> dict[str, str | None]:
    """Map each start method to None when this platform has it, else the reason it has not."""
    available = set(multiprocessing.get_all_start_methods())
    return {
        method: None
        if method == "auto" or method in available
        else f"this platform has no {method!r} start method (it has {', '.join(sorted(available))})"
        for method in START_METHODS
    }


def choices(report: HardwareReport) -> dict[str, Any]:
    """What a panel offers: every option, with the reason where the machine cannot run it."""
    return {
        "num_processes": {
            "min": 1,
            "max": max_num_processes(report),
            "default": report.default_num_processes,
        },
        "mixed_precision": precision_support(report),
        "start_method": start_method_support(),
    }


def load_defaults() -> LaunchDefaults:
    """The saved defaults; none saved gives ``LaunchDefaults()``, a broken file a warning too."""
    path = defaults_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return LaunchDefaults()
    except OSError as e:
        _warn_ignored(path, f"it cannot be read ({e.strerror or e})")
        return LaunchDefaults()
    try:
        data = json.loads(text)
    except ValueError as e:
        _warn_ignored(path, f"it is not valid JSON ({e})")
        return LaunchDefaults()
    try:
        return parse_defaults(data)
    except DefaultsError as e:
        _warn_ignored(path, str(e))
        return LaunchDefaults()


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
    count = defaults.num_processes or report.default_num_processes
    device = _DEVICE_WORDS.get(report.accelerator, report.accelerator.upper())
    ranks = f"{count} x {device} rank{'s' if count != 1 else ''}"
    precision = defaults.mixed_precision or "no"
    precision_words = "fp32 (no mixed precision)" if precision == "no" else precision
    method = defaults.start_method or "auto"
    method_words = "start method chosen automatically" if method == "auto" else method
    return f"{ranks}, {precision_words}, {method_words}"


# ---- this kernel's own defaults (set by configure()) ----------------------------------
# Between explicit arguments and the saved file: what configure() picks applies to every
# later launch in this kernel only, until the kernel restarts.
_kernel_layer: LaunchDefaults | None = None


def set_kernel_defaults(defaults: LaunchDefaults | None) -> None:
    """Set (or with None clear) the defaults of this kernel, above the saved file's."""
    global _kernel_layer
    _kernel_layer = defaults


def kernel_defaults() -> LaunchDefaults | None:
    return _kernel_layer


def effective_defaults() -> LaunchDefaults:
    """What a launch uses for arguments left out: this kernel's choice, else the file's."""
    saved = load_defaults()
    layer = _kernel_layer or LaunchDefaults()
    return LaunchDefaults(
        **{
            key: getattr(layer, key) if getattr(layer, key) is not None else getattr(saved, key)
            for key in _KEYS
        }
    )
