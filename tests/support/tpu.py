"""Faked TPU machines for tests: device trees, runtime variables and the fake torch_xla.

A machine is what the kernel would see on each runtime: PCI devices with Google's vendor
id and a TPU device id (as torch_xla counts chips), device files, and the variables the
runtime sets. Only the hardware is fake; detection and the launcher run for real.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FAKE_XLA = str(Path(__file__).parent / "fake_xla")  # put first on sys.path to "install" it


@dataclasses.dataclass(frozen=True)
class Machine:
    name: str
    pci_device: str  # the TPU's PCI device id
    chips: int
    device_files: str  # "accel" (/dev/accelN, v2-v4) or "vfio" (/dev/vfio/N, v5e on)
    environ: dict[str, str]


COLAB = {"COLAB_RELEASE_TAG": "release-colab_20261101-060123_RC00", "COLAB_TPU_1VM": "1"}
KAGGLE = {"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "KAGGLE_URL_BASE": "https://www.kaggle.com"}

MACHINES = {
    "colab-v2-8": Machine(
        "colab-v2-8",
        "0x0027",
        4,
        "accel",
        {**COLAB, "TPU_ACCELERATOR_TYPE": "v2-8", "TPU_NAME": "local"},
    ),
    "kaggle-v3-8": Machine(
        "kaggle-v3-8",
        "0x0027",
        4,
        "accel",
        {**KAGGLE, "TPU_ACCELERATOR_TYPE": "v3-8", "TPU_NAME": "local"},
    ),
    "kaggle-v5e-8": Machine(
        "kaggle-v5e-8",
        "0x0063",
        8,
        "vfio",
        {
            **KAGGLE,
            "TPU_ACCELERATOR_TYPE": "v5litepod-8",
            "TPU_NAME": "local",
            "TPU_PROCESS_ADDRESSES": "local:8476",
            "CLOUD_TPU_TASK_ID": "0",
        },
    ),
    "colab-v5e-1": Machine(
        "colab-v5e-1", "0x0063", 1, "vfio", {**COLAB, "TPU_ACCELERATOR_TYPE": "v5litepod-1"}
    ),
    "colab-v6e-1": Machine(
        "colab-v6e-1", "0x006f", 1, "vfio", {**COLAB, "TPU_ACCELERATOR_TYPE": "v6e-1"}
    ),
    "tpu-vm-v4-8": Machine(
        "tpu-vm-v4-8", "0x005e", 4, "accel", {"TPU_ACCELERATOR_TYPE": "v4-8", "TPU_WORKER_ID": "0"}
    ),
    # One of the 4 hosts of a v4-32 slice.
    "tpu-vm-v4-32": Machine(
        "tpu-vm-v4-32",
        "0x005e",
        4,
        "accel",
        {"TPU_ACCELERATOR_TYPE": "v4-32", "TPU_WORKER_ID": "1"},
    ),
}


def build_root(root: Path, machine: Machine) -> Path:
    """A directory with the machine's ``sys/bus/pci/devices`` and ``dev`` trees."""
    devices = root / "sys/bus/pci/devices"
    # Other PCI devices are there too: a NIC of another vendor, a Google device that is no TPU.
    for address, vendor, device in (
        ("0000:00:04.0", "0x1af4", "0x1000"),
        ("0000:00:05.0", "0x1ae0", "0x0042"),
    ):
        (devices / address).mkdir(parents=True)
        (devices / address / "vendor").write_text(vendor + "\n")
        (devices / address / "device").write_text(device + "\n")
    for chip in range(machine.chips):
        slot = devices / f"0000:00:{chip + 6:02x}.0"
        slot.mkdir(parents=True)
        (slot / "vendor").write_text("0x1ae0\n")
        (slot / "device").write_text(machine.pci_device + "\n")
    dev = root / "dev"
    (dev / "vfio").mkdir(parents=True)
    (dev / "vfio" / "vfio").write_text("")
    for chip in range(machine.chips):
        target = (
            dev / f"accel{chip}" if machine.device_files == "accel" else dev / "vfio" / str(chip)
        )
        target.write_text("")
    return root


def launch_environ(machine: Machine) -> dict[str, str]:
    """The variables a launch test sets: the runtime's, and the fake's chip count."""
    return {**machine.environ, "PJRT_DEVICE": "TPU", "FAKE_TPU_CHIPS": str(machine.chips)}


def forget_fake_xla() -> None:
    for name in [m for m in sys.modules if m == "torch_xla" or m.startswith("torch_xla.")]:
        del sys.modules[name]
    core = sys.modules.get("notebook_launcher.accelerator.xla")
    if core is not None:
        core.started_outside_launch = None
        core._state.active = False


@contextlib.contextmanager
def faked_tpu(monkeypatch: Any, spec: str) -> Iterator[Machine]:
    """The machine named by ``spec`` ("kaggle-v5e-8", or "...+no-torch-xla"), with the fake
    torch_xla installed, for the duration of a test."""
    from notebook_launcher import hardware

    name, *installed = spec.split("+")
    machine = MACHINES[name]
    for key, value in launch_environ(machine).items():
        monkeypatch.setenv(key, value)
    if installed != ["no-torch-xla"]:
        monkeypatch.syspath_prepend(FAKE_XLA)
    hardware.detect(refresh=True)
    try:
        yield machine
    finally:
        monkeypatch.undo()
        forget_fake_xla()
        hardware.detect(refresh=True)
