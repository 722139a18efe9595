"""The example notebooks run top to bottom in a real kernel and show what they promise."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.kernel
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def execute(name: str) -> list[str]:
    notebook = nbformat.read(EXAMPLES / name, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    texts = []
    for cell in notebook.cells:
        if cell.cell_type == "code":
            texts.append("".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream"))
    return texts


def test_quickstart_trains_on_two_ranks_and_shows_what_each_did():
    outputs = "\n".join(execute("01_quickstart.ipynb"))
    assert "[rank0]: rank 0 of 2: 128 samples, first index 0" in outputs
    assert "[rank1]: rank 1 of 2: 128 samples, first index 1" in outputs
    assert "[rank1]: rank 1 epoch 4: last batch loss" in outputs
    learned = next(line for line in outputs.splitlines() if line.startswith("learned:"))
    weights = [float(w) for w in learned.split("[")[1].rstrip("]").split(",")]
    assert all(abs(w - target) < 0.5 for w, target in zip(weights, range(1, 9)))
    assert "ranks agree: True" in outputs
    assert "caught: Rank 1 (pid" in outputs and "learning rate 10.0 is too large for rank 1" in outputs
