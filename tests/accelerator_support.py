"""Running a script on several CPU ranks under torchrun, for the accelerator tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "accelerator_scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def run_torchrun(
    script: Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
        *args,
    ]
    result = subprocess.run(
        command, env=env or clean_environment(), capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise AssertionError(
            f"torchrun {script.name} exited with {result.returncode}\n--- stdout\n{result.stdout[-6000:]}"
            f"\n--- stderr\n{result.stderr[-10000:]}"
        )
    return result
