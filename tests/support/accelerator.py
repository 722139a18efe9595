"""Running a script on several CPU ranks under torchrun, for the accelerator tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "accelerator_scripts"


LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def is_launch_variable(name: str) -> bool:
    return name in LAUNCH_VARS or name.startswith(("ACCELERATE_", "NOTEBOOK_LAUNCHER_"))


@pytest.fixture
def plain_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This test runs as one plain process: no rank or launcher variables.

    Launches it starts register in a private runtime directory, so a JupyterLab sidebar
    (or its tests) running on the same machine neither lists nor stops them.
    """
    for name in [k for k in os.environ if is_launch_variable(k)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter-runtime"))


def clean_environment(**extra: str) -> dict[str, str]:
    """The test process's environment without any launch variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not is_launch_variable(k)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    env.update(extra)
    return env


# A port found free is let go before torchrun binds it: another suite on the machine may
# take it meanwhile, and torchrun then fails at once; tried again on a fresh port.
_PORT_TRIES = 3


def lost_its_port(output: str) -> bool:
    """Whether torchrun failed because its master port was taken meanwhile."""
    return "EADDRINUSE" in output


def torchrun_command(script: Path, *args: str, nproc: int = 2) -> list[str]:
    """torchrun of ``script`` on loopback, its master on a port found free now."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
        *args,
    ]


def run_torchrun(
    script: Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 900,  # a safety net: a case takes seconds alone, up to minutes on a busy machine
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    for attempt in range(1, _PORT_TRIES + 1):
        result = subprocess.run(
            torchrun_command(script, *args, nproc=nproc),
            env=env or clean_environment(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if not (result.returncode != 0 and lost_its_port(result.stderr) and attempt < _PORT_TRIES):
            break
    if result.returncode != 0:
        raise AssertionError(
            f"torchrun {script.name} exited with {result.returncode}\n--- stdout\n{result.stdout[-6000:]}"
            f"\n--- stderr\n{result.stderr[-10000:]}"
        )
    return result


def read_wandb_offline(run_file: Path) -> list[Any]:
    """The records of an offline W&B run file (``run-<id>.wandb``), as protobuf ``Record`` objects.

    The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB
    blocks of chunks (crc32c 4 bytes, length 2, type 1: full, first, middle, last).
    """
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file} is not a W&B run file")
    block, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left  # block trailer: zero padding
            continue
        length = int.from_bytes(data[position + 4 : position + 6], "little")
        kind = data[position + 6]
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # full or last: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records
