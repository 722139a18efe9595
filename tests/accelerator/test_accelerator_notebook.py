"""The teaching notebook, executed in a real Jupyter kernel: what its reader would see."""

from __future__ import annotations

import os

import nbformat
import pytest

from tests.support.accelerator import REPO, is_launch_variable
from tests.support.kernel_driver import execute_notebook

NOTEBOOK = REPO / "examples" / "02_accelerator_teaching.ipynb"
pytestmark = pytest.mark.kernel


def cell_text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif "data" in output and "text/plain" in output.data:
            parts.append(output.data["text/plain"] + "\n")
    return "".join(parts)


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel inherits this environment: a plain one that imports this source tree.
    with pytest.MonkeyPatch.context() as env:
        for name in [k for k in os.environ if is_launch_variable(k)]:
            env.delenv(name)
        # Its launches register privately: a JupyterLab sidebar elsewhere cannot stop them.
        env.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path_factory.mktemp("jupyter-runtime")))
        env.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        )
        execute_notebook(notebook, str(NOTEBOOK.parent), timeout=180)
    return [cell_text(cell) for cell in notebook.cells if cell.cell_type == "code"]


def test_the_notebook_runs_without_errors_and_stores_no_outputs(executed: list[str]) -> None:
    stored = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in stored.cells if cell.cell_type == "code")
    assert len(executed) == 7


def test_each_rank_reports_its_shard_and_together_they_cover_the_data(executed: list[str]) -> None:
    shown = executed[1]
    assert "[rank0]: rank 0 of 2 on cpu, precision 'no'" in shown
    assert "[rank1]: rank 1 of 2 on cpu, precision 'no'" in shown
    assert "together: True" in shown and "overlap: set()" in shown


def test_gradients_differ_locally_and_agree_after_synchronisation(executed: list[str]) -> None:
    shown = executed[2]
    for line in (
        "local gradients differ between ranks: True",
        "synchronised gradients equal on both ranks: True",
        "they are the average of the local ones: True",
        "equal to one process with batch 32: True",
    ):
        assert line in shown


def test_training_prints_once_and_gathered_metrics_count_each_sample_once(
    executed: list[str],
) -> None:
    assert executed[3].count("[rank0]: epoch") == 5 and "[rank1]" not in executed[3]
    assert "one prediction per validation sample: True" in executed[4]
    assert "matches the reloaded model: True" in executed[4]
    mse = float(executed[4].split("validation MSE over all 50 samples: ")[1].split()[0])
    assert mse < 0.5  # it learned: predicting zero gives about 3


def test_the_launchers_bf16_reaches_the_model(executed: list[str]) -> None:
    assert "('bf16', torch.bfloat16, torch.float32)" in executed[5]
