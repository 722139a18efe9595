"""The panel and the live dashboard in the classic Notebook with ipywidgets 7, as Colab's
runtime ships them (notebook 6.5.7, widgetsnbextension 3.6.10, ipywidgets 7.7.1).

They need an environment of their own, pinned like Colab's (compat/colab.txt): give its
python in NOTEBOOK_LAUNCHER_CLASSIC_PYTHON. The browser is driven from this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from .conftest import CHROMIUM, ROOT

CLASSIC_PYTHON = os.environ.get("NOTEBOOK_LAUNCHER_CLASSIC_PYTHON", "")

pytestmark = pytest.mark.skipif(
    not (CLASSIC_PYTHON and Path(CLASSIC_PYTHON).exists() and CHROMIUM.exists()),
    reason="needs NOTEBOOK_LAUNCHER_CLASSIC_PYTHON: the python of an environment pinned like "
    "Colab's (notebook 6, ipywidgets 7; compat/colab.txt), and chromium",
)

CELLS = [
    "from notebook_launcher import configure\nconfigure()",
    "import time\n"
    "from notebook_launcher import Accelerator, notebook_launcher\n\n\n"
    "def train(steps):\n"
    "    acc = Accelerator()\n"
    "    loss = 2.0\n"
    "    for step in acc.tqdm(range(steps), desc='training'):\n"
    "        loss *= 0.93 + 0.02 * acc.process_index\n"
    "        acc.log({'loss': loss}, step=step)\n"
    "        time.sleep(0.25)  # a step's work: the dashboard is seen while it runs\n"
    "    return loss\n\n\n"
    "notebook_launcher(train, args=(80,), num_processes=2, hardware='cpu')",
]


def test_the_panel_and_the_live_dashboard_render_in_the_classic_notebook_with_ipywidgets_7(
    tmp_path,
):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(notebook, tmp_path / "dashboard.ipynb")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("classic_notebook_run.py")), CLASSIC_PYTHON, str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "2 x cpu ranks" in found["live"] and "training:" in found["live"]
    assert (
        "finished after" in found["record"] and "160 points drawn of 160 logged" in found["record"]
    )
    assert found["widget errors"] == 0
    for name in ("configure-classic", "dashboard-live-classic-notebook"):
        (ROOT / "artifacts").mkdir(exist_ok=True)
        (tmp_path / f"{name}.png").replace(ROOT / "artifacts" / f"{name}.png")
