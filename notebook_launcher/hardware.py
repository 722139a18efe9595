"""What this machine can run ranks on, detected without initialising CUDA.

The report is read by the launcher (defaults, validation), the notebook panel, the
JupyterLab server extension and the CLI. GPUs are found with ``nvidia-smi`` (the
driver's own tool) rather than ``torch.cuda``, because a CUDA context created in the
kernel makes every later ``fork`` unsafe. Tests fake the hardware by putting a fake
``nvidia-smi`` on PATH or by setting the platform's environment variables.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

from notebook_launcher import rules
from notebook_launcher.machine import GpuInfo, Machine
from notebook_launcher.tpu import detect_tpu

# Re-exported for the training core, which judges a precision inside a rank.
PRECISIONS = rules.PRECISIONS
precision_support = rules.precision_support
_NVIDIA_SMI_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class HardwareReport(Machine):
    """This machine's facts (see :class:`~notebook_launcher.machine.Machine`), with what the
    rules derive from them."""

    @property
    def default_num_processes(self) -> int:
        return rules.default_num_processes(self)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["accelerator"] = self.accelerator
        data["tpu_summary"] = self.tpu.describe() if self.tpu is not None else None
        data["default_num_processes"] = rules.default_num_processes(self)
        data["max_num_processes"] = rules.max_num_processes(self)
        data["precisions"] = rules.precision_support(self)
        return data


@functools.lru_cache(maxsize=1)
def _cached_report() -> HardwareReport:
    return _detect()


def detect(refresh: bool = False) -> HardwareReport:
    """The hardware report; cached per process since hardware does not change under a kernel."""
    if refresh:
        _cached_report.cache_clear()
    return _cached_report()


def _detect() -> HardwareReport:
    gpus, driver = _detect_gpus()
    tpu = detect_tpu()
    return HardwareReport(
        cpu_count=available_cpu_count(),
        gpus=gpus,
        driver_version=driver,
        # XLA on the CPU (PJRT_DEVICE=CPU) is reported in `tpu` but has no TPU cores.
        tpu_cores=tpu.cores if tpu is not None and tpu.pjrt_device == "TPU" else 0,
        mps_available=_detect_mps(),
        platform=detect_platform(),
        python_version=platform.python_version(),
        torch_version=_version_of("torch"),
        torch_xla_version=_version_of("torch_xla") or _version_of("torch-xla"),
        tpu=tpu,
    )


def available_cpu_count() -> int:
    """Cores this process may run on (the affinity mask, which containers narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def detect_platform(environ: os._Environ[str] | dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    if "COLAB_RELEASE_TAG" in env or "COLAB_GPU" in env or "google.colab" in sys.modules:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env:
        return "kaggle"
    if "TPU_ACCELERATOR_TYPE" in env or "TPU_WORKER_ID" in env:
        return "tpu-vm"
    return "local"


def _detect_gpus() -> tuple[tuple[GpuInfo, ...], str | None]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return (), None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return (), None
    try:
        out = subprocess.run(
            [
                smi,
                "--query-gpu=index,name,memory.total,compute_cap,driver_version",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=_NVIDIA_SMI_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return (), None
    gpus: list[GpuInfo] = []
    driver: str | None = None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 5 or not fields[0].isdigit():
            continue
        memory = int(fields[2]) if fields[2].isdigit() else 0
        gpus.append(GpuInfo(int(fields[0]), fields[1], memory, fields[3].replace("[N/A]", "")))
        driver = fields[4]
    return _apply_visible_devices(gpus, visible), driver


def _apply_visible_devices(gpus: list[GpuInfo], visible: str | None) -> tuple[GpuInfo, ...]:
    """Keep the GPUs CUDA_VISIBLE_DEVICES shows, renumbered as CUDA will see them."""
    if visible is None:
        return tuple(gpus)
    by_index = {g.index: g for g in gpus}
    shown: list[GpuInfo] = []
    for token in visible.split(","):
        token = token.strip()
        if not token.isdigit() or int(token) not in by_index:
            break  # CUDA stops at the first entry it cannot resolve (UUIDs are not mapped here)
        shown.append(dataclasses.replace(by_index[int(token)], index=len(shown)))
    return tuple(shown)


def _detect_mps() -> bool:
    if sys.platform != "darwin" or "torch" not in sys.modules:
        return False
    import torch

    return bool(torch.backends.mps.is_available())


def _version_of(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
