"""binder/: the environment mybinder builds installs the package with both extensions and runs
the examples. Built here in a fresh venv exactly as repo2docker does (pip, from the repo root).

Slow (a venv with torch and JupyterLab: a few minutes); the build uses the lab extension
already built in notebook_launcher/labextension, or builds it with the machine's node.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytestmark = [
    pytest.mark.slow(reason="builds the binder environment in a fresh venv: 2 to 3 min"),
    pytest.mark.timeout(1200),
]

ROOT = Path(__file__).resolve().parent.parent
# The examples run, with their claims checked, in test_examples.py and test_course.py; here
# one proves that the binder environment runs them from the installed package.
TOUR = ROOT / "examples" / "00_sidebar_tour.ipynb"

# The one version of the project (the Python build reads it from there too).
VERSION = json.loads((ROOT / "extension" / "package.json").read_text())["version"]


def _run(args: list[str], env: dict[str, str], cwd: Path = ROOT, timeout: float = 900) -> str:
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        pytest.fail(
            f"{' '.join(args)} exited with {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
    return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)  # jupyter colours its lists


@pytest.fixture(scope="module")
def binder_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A fresh venv with binder/requirements.txt installed; returns the environment to use it."""
    base = tmp_path_factory.mktemp("binder")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not key.startswith("JUPYTER")
    }
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(venv),
        HOME=str(base / "home"),
        JUPYTER_CONFIG_DIR=str(base / "config"),
        JUPYTER_DATA_DIR=str(base / "data"),
        JUPYTER_RUNTIME_DIR=str(base / "runtime"),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    # The same pins without PyTorch's CPU index, which this machine cannot reach (it holds
    # that wheel on disk); pip resolves "." from the repository root, as on mybinder.
    requirements = base / "requirements.txt"
    requirements.write_text(
        "".join(
            line
            for line in (ROOT / "binder" / "requirements.txt").read_text().splitlines(keepends=True)
            if not line.startswith("--extra-index-url")
        )
    )
    _run([str(venv / "bin" / "pip"), "install", "-r", str(requirements)], env)
    return env


def test_the_binder_env_has_the_package_and_both_extensions_enabled(
    binder_env: dict[str, str],
) -> None:
    torch = _run(["python", "-c", "import torch; print(torch.__version__)"], binder_env)
    assert torch.strip().startswith("2.13.0")
    labextensions = _run(["jupyter", "labextension", "list"], binder_env)
    assert re.search(
        rf"notebook-launcher-labextension v{re.escape(VERSION)} enabled\s+OK \(python, notebook-launcher\)",
        labextensions,
    ), labextensions
    server_extensions = _run(["jupyter", "server", "extension", "list"], binder_env)
    assert re.search(r"notebook_launcher\.server enabled", server_extensions), server_extensions
    assert re.search(r"notebook_launcher\.server \S* ?OK", server_extensions), server_extensions
    assert "jupyter_server_config.d/notebook_launcher.json" in _run(
        [
            "python",
            "-c",
            "import sys, pathlib; print(*pathlib.Path(sys.prefix).rglob('notebook_launcher.json'))",
        ],
        binder_env,
    )


def test_the_sidebar_tour_runs_in_the_binder_env_from_the_installed_package(
    binder_env: dict[str, str], tmp_path: Path
) -> None:
    notebook = TOUR
    executed = tmp_path / notebook.name
    _run(
        [
            "jupyter", "nbconvert", "--to", "notebook", "--execute",
            "--ExecutePreprocessor.timeout=600", f"--output={executed}", str(notebook),
        ],
        binder_env,
        cwd=notebook.parent,
    )  # fmt: skip
    ran = nbformat.read(executed, as_version=4)
    # A cell tagged "raises-exception" shows a failing rank on purpose; no other cell may fail.
    errors = [
        o
        for c in ran.cells
        if c.cell_type == "code" and "raises-exception" not in c.metadata.get("tags", [])
        for o in c.outputs
        if o.output_type == "error"
    ]
    assert errors == []
    text = "".join(o.get("text", "") for c in ran.cells if c.cell_type == "code" for o in c.outputs)
    # The installed package (not the source tree) ran, and read the hardware and defaults.
    assert f"notebook_launcher {VERSION}\n" in text
    assert "accelerator: " in text
    assert "notebook_launcher() will run: " in text
