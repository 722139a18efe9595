"""What TPU this machine has, read from its environment and device files.

torch_xla is never imported here: importing it picks a PJRT device and using it starts a
runtime that can run only once per process, after which every forked rank fails with
"Runtime is already initialized". So the chips are counted the way torch_xla itself counts
them before it starts anything (Google's PCI vendor and TPU device ids under
``/sys/bus/pci/devices``), with ``/dev/accel*`` and ``/dev/vfio/N`` device files and the
runtime's variables (``TPU_ACCELERATOR_TYPE``, ``TPU_NAME``, ``PJRT_DEVICE``,
``TPU_PROCESS_BOUNDS``) as further evidence. Tests fake a machine by passing an
environment and a root directory holding fake ``sys`` and ``dev`` trees.

torch_xla starts one process per chip. Chips of TPU v2 and v3 show two XLA devices each,
which torch_xla runs as two threads of one process; later chips show one.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Mapping
from pathlib import Path

GOOGLE_PCI_VENDOR = "0x1ae0"
# Device id -> generation, as torch_xla's own list (torch_xla/_internal/tpu.py) names them.
PCI_DEVICE_GENERATIONS = {
    "0x0027": "v2/v3",  # the same id for both: the accelerator type tells them apart
    "0x005e": "v4",
    "0x0063": "v5e",
    "0x006f": "v6e",
    "0x0076": "v7x",
    "0x0056": "",  # ids torch_xla accepts for testing boards
    "0x0062": "",
}
# Accelerator-type prefixes -> generation ("v5litepod-8" is Cloud's name for a v5e-8).
_TYPE_GENERATIONS = {"v5litepod": "v5e", "v5lite": "v5e", "tpu7x": "v7x", "v7": "v7x"}
# Generations whose type suffix counts TensorCores (2 per chip); later ones count chips.
_SUFFIX_COUNTS_CORES = ("v2", "v3", "v4", "v5p")
_TWO_DEVICES_PER_CHIP = ("v2", "v3")  # torch_xla: "2 if version() <= 3 else 1"
_TYPE = re.compile(r"^(?P<prefix>[a-z]+\d[a-z]*)-(?P<count>\d+)$")


@dataclasses.dataclass(frozen=True)
class TpuInfo:
    """The TPU of this machine (this host, for a slice of several hosts)."""

    generation: str  # "v2", "v3", "v4", "v5e", "v5p", "v6e", "v7x"; "" when not known
    accelerator_type: str  # as the runtime names it ("v5litepod-8", "v2-8"); "" when not set
    chips: int  # chips attached to this host
    cores_per_chip: int  # XLA devices per chip: 2 on v2/v3 (threads of one process), else 1
    processes: (
        int  # processes torch_xla starts here: one per chip unless TPU_PROCESS_BOUNDS narrows
    )
    hosts: int  # hosts of the slice; a launch here uses this host's chips only
    pjrt_device: str  # the device PJRT will use: "TPU", or "CPU" when PJRT_DEVICE=CPU is set
    libtpu_version: str | None
    evidence: tuple[str, ...]  # what revealed the TPU, for the report and bug reports

    @property
    def cores(self) -> int:
        """XLA devices on this host, the replicas that run the function."""
        return self.chips * self.cores_per_chip

    def describe(self) -> str:
        """One line for a person: "TPU v5e-8: 8 chips, 8 cores, 8 processes"."""
        if self.pjrt_device != "TPU":
            return (
                f"XLA on {self.pjrt_device} (PJRT_DEVICE={self.pjrt_device}): "
                f"{self.processes} process, {self.cores} device(s)"
            )
        name = self.accelerator_type or self.generation or "TPU"
        threads = (
            f" of {self.cores_per_chip} device threads each" if self.cores_per_chip > 1 else ""
        )
        return (
            f"TPU {name}: {self.chips} chip(s), {self.cores} core(s), "
            f"{self.processes} process(es){threads}"
        )


def detect_tpu(
    environ: Mapping[str, str] | None = None, root: str | os.PathLike[str] = "/"
) -> TpuInfo | None:
    """The TPU this machine has, or None; PJRT_DEVICE=CPU gives XLA on the CPU instead."""
    env = os.environ if environ is None else environ
    root = Path(root)
    evidence: list[str] = []
    pjrt = env.get("PJRT_DEVICE", "").strip().upper().split("_")[0]
    pci_chips, pci_generation = _pci_chips(root)
    if pci_chips:
        evidence.append(f"{pci_chips} TPU chip(s) on the PCI bus")
    device_files = _device_files(root)
    if device_files:
        evidence.append(f"{device_files} TPU device file(s) in /dev")
    accelerator_type = (
        env.get("TPU_ACCELERATOR_TYPE") or env.get("ACCELERATOR_TYPE") or ""
    ).strip()
    if accelerator_type:
        evidence.append(f"TPU_ACCELERATOR_TYPE={accelerator_type}")
    if env.get("TPU_NAME"):
        evidence.append(f"TPU_NAME={env['TPU_NAME']}")
    if pjrt:
        evidence.append(f"PJRT_DEVICE={pjrt}")
    libtpu = _libtpu_version()
    if pjrt and pjrt != "TPU":
        if pjrt != "CPU" or not xla_installed():
            return None  # another PJRT device (CUDA, NEURON): not ours to run
        return _xla_on_cpu(env, libtpu, tuple(evidence))
    type_generation, type_chips, _ = parse_accelerator_type(accelerator_type)
    hosts, _why = slice_hosts(env)
    # Device files alone could be another vendor's (VFIO passthrough, other accelerators).
    corroborated = bool(accelerator_type or env.get("TPU_NAME") or pjrt == "TPU" or libtpu)
    chips = pci_chips or (device_files if corroborated else 0)
    if not chips and (type_chips or pjrt == "TPU"):
        # No device is visible (a container without /sys), but the runtime says there is one.
        chips = max(type_chips, 1)
    if not chips:
        return None
    generation = type_generation or (pci_generation if pci_generation != "v2/v3" else "")
    cores_per_chip = 2 if generation in _TWO_DEVICES_PER_CHIP or pci_generation == "v2/v3" else 1
    if libtpu:
        evidence.append(f"libtpu {libtpu}")
    return TpuInfo(
        generation=generation,
        accelerator_type=accelerator_type,
        chips=chips,
        cores_per_chip=cores_per_chip,
        processes=_processes(chips, env),
        hosts=hosts,
        pjrt_device="TPU",
        libtpu_version=libtpu,
        evidence=tuple(evidence),
    )


def parse_accelerator_type(accelerator_type: str) -> tuple[str, int, int]:
    """(generation, chips on one host, hosts) from a name like "v3-8" or "v5litepod-16"."""
    match = _TYPE.match(accelerator_type.strip().lower())
    if not match:
        return "", 0, 1
    prefix, count = match["prefix"], int(match["count"])
    generation = _TYPE_GENERATIONS.get(prefix, prefix)
    total_chips = max(1, count // 2) if generation in _SUFFIX_COUNTS_CORES else count
    per_host = total_chips if total_chips <= 8 else 4
    if generation in _SUFFIX_COUNTS_CORES:
        per_host = min(total_chips, 4)  # hosts of these generations carry 4 chips
    hosts = -(-total_chips // per_host)
    return generation, per_host, hosts


def slice_hosts(environ: Mapping[str, str]) -> tuple[int, str]:
    """Hosts of this TPU slice as the runtime's variables tell them, and which one said so.

    torch_xla reads several: the accelerator type, ``TPU_WORKER_HOSTNAMES`` (one name per
    host) and ``TPU_HOST_BOUNDS`` (the hosts' grid, "2,2,1" for 4); the largest count wins,
    since the runtime waits for every host any of them names.
    """
    found = [(1, "")]
    accelerator_type = (
        environ.get("TPU_ACCELERATOR_TYPE") or environ.get("ACCELERATOR_TYPE") or ""
    ).strip()
    type_hosts = parse_accelerator_type(accelerator_type)[2]
    found.append((type_hosts, f"TPU_ACCELERATOR_TYPE={accelerator_type}"))
    names = [n for n in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if n.strip()]
    found.append((len(names), f"TPU_WORKER_HOSTNAMES lists {len(names)} hosts"))
    bounds = environ.get("TPU_HOST_BOUNDS", "").strip()
    try:
        dims = [int(d) for d in bounds.split(",")] if bounds else []
    except ValueError:
        dims = []
    if dims and all(d > 0 for d in dims):
        grid = 1
        for d in dims:
            grid *= d
        found.append((grid, f"TPU_HOST_BOUNDS={bounds}"))
    return max(found, key=lambda item: item[0])


_METADATA_HOST = "169.254.169.254"  # metadata.google.internal, without a DNS lookup


def metadata_worker_count(timeout: float = 1.0) -> int | None:
    """Hosts of this TPU slice from the VM's metadata (``worker-network-endpoints``).

    torch_xla asks the metadata server when ``TPU_SKIP_MDS_QUERY`` is not set; None when
    the server does not answer (no Google Cloud VM) or has no such entry.
    ``GCE_METADATA_HOST`` points elsewhere, as Google's own client libraries allow.
    """
    return _metadata_workers(os.environ.get("GCE_METADATA_HOST") or _METADATA_HOST, timeout)


@functools.lru_cache(maxsize=8)
def _metadata_workers(host: str, timeout: float) -> int | None:
    """Asked once per kernel: a VM's slice does not change, and no answer costs ``timeout``."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"http://{host}/computeMetadata/v1/instance/attributes/worker-network-endpoints",
        headers={"Metadata-Flavor": "Google"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read(1 << 20).decode("utf-8", "replace")
    except (OSError, ValueError, urllib.error.URLError):
        return None
    workers = [w for w in text.strip().split(",") if w.strip()]
    return len(workers) or None


def xla_installed() -> bool:
    """torch_xla can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec("torch_xla") is not None
    except (ImportError, ValueError):
        return False


def _xla_on_cpu(env: Mapping[str, str], libtpu: str | None, evidence: tuple[str, ...]) -> TpuInfo:
    raw = env.get("CPU_NUM_DEVICES", "").strip()
    devices = int(raw) if raw.isdigit() and int(raw) > 0 else 1
    # xmp.spawn on CPU always starts one process; CPU_NUM_DEVICES gives it threads.
    return TpuInfo(
        generation="",
        accelerator_type="",
        chips=1,
        cores_per_chip=devices,
        processes=1,
        hosts=1,
        pjrt_device="CPU",
        libtpu_version=libtpu,
        evidence=evidence,
    )


def _processes(chips: int, env: Mapping[str, str]) -> int:
    """torch_xla's num_local_processes: one per chip, at most the product of TPU_PROCESS_BOUNDS."""
    bounds = env.get("TPU_PROCESS_BOUNDS", "").strip()
    try:
        dims = [int(d) for d in bounds.split(",")] if bounds else []
    except ValueError:
        dims = []
    total = 1
    for d in dims:
        total *= d
    return min(chips, total) if dims and total > 0 else chips


def _pci_chips(root: Path) -> tuple[int, str]:
    chips = 0
    generations: set[str] = set()
    for vendor_file in sorted((root / "sys/bus/pci/devices").glob("*/vendor")):
        try:
            if vendor_file.read_text().strip() != GOOGLE_PCI_VENDOR:
                continue
            device = (vendor_file.parent / "device").read_text().strip()
        except OSError:
            continue
        if device in PCI_DEVICE_GENERATIONS:
            chips += 1
            generations.add(PCI_DEVICE_GENERATIONS[device])
    return chips, generations.pop() if len(generations) == 1 else ""


def _device_files(root: Path) -> int:
    """TPU chips as device files: /dev/accelN (v2-v4) or /dev/vfio/N (v5e and later)."""
    accel = [p for p in _names(root / "dev") if p.startswith("accel") and p[5:].isdigit()]
    if accel:
        return len(accel)
    return len([p for p in _names(root / "dev/vfio") if p.isdigit()])


def _names(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def _libtpu_version() -> str | None:
    for distribution in ("libtpu", "libtpu-nightly"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
