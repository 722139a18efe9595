"""Checks made before a GPU launch, for the traps users of notebooks fall into most.

- A GPU whose compute capability the installed torch has no kernels for (Kaggle's P100,
  sm_60, under a torch built for sm_70 and later; a Blackwell GPU, sm_120, under an older
  build) fails inside every rank with "no kernel image is available": refused before the
  launch, with the fix.
- NCCL hangs between GPUs whose peer-to-peer access does not work, and fails in a small
  ``/dev/shm`` (64 MB in Docker). Peer access is probed in a throwaway subprocess, so that
  CUDA never starts in the kernel; ``/dev/shm`` is measured. Where either fails, the
  variable that makes NCCL go around it is set in the ranks, and said in one line.

Detection reads what the driver's tools and the filesystem say; tests fake those readings.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from notebook_launcher.errors import LaunchConfigError
from notebook_launcher.machine import GpuInfo

# NCCL's shared-memory transport takes a few MB per peer and channel; below this, NCCL 2.x
# fails with "unhandled system error" (Docker's default /dev/shm is 64 MB).
SHM_NEEDED_BYTES = 512 * 2**20
PROBE_TIMEOUT_S = 60.0

# Copies a tensor from each GPU to each other and checks it arrived: a pair whose peer
# access is claimed but broken hangs or garbles here, not in the ranks' NCCL.
_PROBE = """
import json, sys, torch
n = torch.cuda.device_count()
failed = []
for i in range(n):
    for j in range(n):
        if i == j:
            continue
        try:
            ok = torch.cuda.can_device_access_peer(i, j)
            if ok:
                x = torch.arange(1 << 20, device=f"cuda:{i}", dtype=torch.float32)
                y = x.to(f"cuda:{j}")
                torch.cuda.synchronize(j)
                ok = bool(torch.equal(y.cpu(), x.cpu()))
        except Exception:
            ok = False
        if not ok:
            failed.append([i, j])
print(json.dumps({"count": n, "failed": failed}))
"""


# ---- compute capability against torch's built architectures --------------------------------


def torch_arch_list() -> list[str] | None:
    """The architectures the installed torch was built for ("sm_70", "compute_90"), read
    without initialising CUDA; None for a CPU build or where torch cannot say."""
    try:
        import torch
    except ImportError:
        return None
    flags = getattr(torch._C, "_cuda_getArchFlags", None)
    if flags is None:
        return None
    try:
        text = flags()
    except Exception:
        return None
    return text.split() if text else None


def _sm(capability: str) -> int | None:
    major, _, minor = capability.partition(".")
    if not major.isdigit() or not (minor or "0").isdigit():
        return None
    return int(major) * 10 + int(minor or "0")


def arch_supported(capability: str, arch_list: Sequence[str]) -> bool:
    """Whether torch built for ``arch_list`` runs on a GPU of ``capability`` ("6.0"): a
    binary for the same major version and a lower or equal minor, or PTX for an older
    architecture (which the driver compiles for newer GPUs)."""
    sm = _sm(capability)
    if sm is None:
        return True  # the driver did not say: not refused on a guess
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        number = number.rstrip("abf")  # sm_90a: the same architecture, with extra features
        if not number.isdigit():
            continue
        built = int(number)
        if kind == "sm" and built // 10 == sm // 10 and built <= sm:
            return True
        if kind == "compute" and built <= sm:
            return True
    return False


def check_architectures(
    gpus: Sequence[GpuInfo], arch_list: Sequence[str] | None, torch_version: str | None
) -> None:
    """LaunchConfigError naming each GPU the installed torch has no kernels for, and the fix."""
    if not arch_list:
        return
    refused = [g for g in gpus if not arch_supported(g.compute_capability, arch_list)]
    if not refused:
        return
    sms = sorted({_sm(g.compute_capability) or 0 for g in refused})
    built = " ".join(a for a in arch_list if a.startswith("sm_"))
    names = ", ".join(
        f"GPU {g.index} ({g.name}, compute capability {g.compute_capability})" for g in refused
    )
    oldest_built = min((_sm_of(a) for a in arch_list if a.startswith("sm_")), default=0)
    if max(sms) < oldest_built:
        fix = (
            "Install a torch build that still has kernels for it (an older CUDA build from "
            "https://download.pytorch.org/whl/, checked with torch.cuda.get_arch_list()), or "
            'run on the CPU with hardware="cpu".'
        )
    else:
        fix = (
            "Install a torch built with a newer CUDA that has kernels for it (pip install -U "
            "torch --index-url https://download.pytorch.org/whl/cu128 or later for sm_120), or "
            'run on the CPU with hardware="cpu".'
        )
    raise LaunchConfigError(
        f"{names}: the installed torch{' ' + torch_version if torch_version else ''} was built for {built} and has no "
        f"kernels for sm_{'/sm_'.join(str(s) for s in sms)}, so every rank would fail with "
        f'"no kernel image is available for execution on the device". {fix}'
    )


def _sm_of(arch: str) -> int:
    number = arch.partition("_")[2].rstrip("abf")
    return int(number) if number.isdigit() else 0


def usable_gpus(gpus: Sequence[GpuInfo]) -> dict[int, bool]:
    """GPU index -> whether the installed torch has kernels for it (the configure panel)."""
    arch_list = torch_arch_list()
    return {g.index: not arch_list or arch_supported(g.compute_capability, arch_list) for g in gpus}


# ---- NCCL between the GPUs of this machine ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NcclSettings:
    """Variables to set in every rank, and the line that says why, one per variable."""

    environ: Mapping[str, str]
    lines: tuple[str, ...]


def nccl_settings(
    num_gpus: int,
    environ: Mapping[str, str],
    failed_pairs: Sequence[tuple[int, int]] | None,
    shm_bytes: int | None,
) -> NcclSettings:
    """What to set for a NCCL launch on ``num_gpus`` GPUs, given the probe's broken pairs
    (None: not probed) and the size of /dev/shm (None: not measured). A variable the user
    set already is left as it is."""
    env: dict[str, str] = {}
    lines: list[str] = []
    if num_gpus > 1 and failed_pairs and "NCCL_P2P_DISABLE" not in environ:
        pairs = ", ".join(f"{i}->{j}" for i, j in failed_pairs[:6])
        env["NCCL_P2P_DISABLE"] = "1"
        lines.append(
            f"notebook_launcher: peer-to-peer access between GPUs failed its probe ({pairs}), "
            "where NCCL would hang: NCCL_P2P_DISABLE=1 is set in the ranks (NCCL goes through "
            "host memory instead)."
        )
    if num_gpus > 1 and shm_bytes is not None and shm_bytes < SHM_NEEDED_BYTES:
        if "NCCL_SHM_DISABLE" not in environ:
            env["NCCL_SHM_DISABLE"] = "1"
            lines.append(
                f"notebook_launcher: /dev/shm holds {shm_bytes // 2**20} MB, too small for NCCL's "
                f"shared memory (it needs about {SHM_NEEDED_BYTES // 2**20} MB): "
                "NCCL_SHM_DISABLE=1 is set in the ranks. A bigger /dev/shm (docker run "
                "--shm-size=1g) is faster."
            )
    return NcclSettings(env, tuple(lines))


def shm_size(path: str = "/dev/shm") -> int | None:
    """The size of the shared-memory filesystem, in bytes; None where there is none."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_blocks * stat.f_frsize


@functools.lru_cache(maxsize=4)
def probe_peer_access(visible: str | None) -> tuple[tuple[int, int], ...] | None:
    """Pairs of GPUs (as CUDA numbers them) whose peer copy failed, from a subprocess of its
    own; None where the probe itself could not run (its answer then says nothing)."""
    env = dict(os.environ)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return ((0, 1),)  # a peer copy that hangs is the trap itself
    except OSError:
        return None
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        return tuple((int(i), int(j)) for i, j in answer["failed"])
    except (ValueError, IndexError, KeyError, TypeError):
        return None
