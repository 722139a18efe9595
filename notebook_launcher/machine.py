"""What a machine has, as plain data: the facts the launch rules judge.

:mod:`notebook_launcher.hardware` detects these facts and reports them (its
``HardwareReport`` adds what the rules derive from them); :mod:`notebook_launcher.rules`
judges them. They live apart from both so that the imports run one way: facts, then
rules, then the report.
"""

from __future__ import annotations

import dataclasses

from notebook_launcher.tpu import TpuInfo


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_mib: int
    compute_capability: str  # "9.0"; "" where the driver does not say


@dataclasses.dataclass(frozen=True)
class Machine:
    cpu_count: int
    gpus: tuple[GpuInfo, ...]
    driver_version: str | None
    tpu_cores: int
    mps_available: bool
    platform: str  # "colab", "kaggle", "tpu-vm" or "local"
    python_version: str
    torch_version: str | None
    torch_xla_version: str | None
    tpu: TpuInfo | None = None  # the TPU (or XLA on CPU with PJRT_DEVICE=CPU), see tpu.py

    @property
    def accelerator(self) -> str:
        """The device kind ranks run on by default: "cuda", "tpu", "mps" or "cpu"."""
        if self.gpus:
            return "cuda"
        if self.tpu_cores:
            return "tpu"
        if self.mps_available:
            return "mps"
        return "cpu"
