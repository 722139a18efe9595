"""The example notebooks run top to bottom in a real kernel and show what they promise."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from tests.support.kernel_driver import execute_notebook

pytestmark = pytest.mark.kernel
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def execute(name: str) -> nbformat.NotebookNode:
    notebook = nbformat.read(EXAMPLES / name, as_version=4)
    execute_notebook(notebook, str(EXAMPLES), timeout=300)
    return notebook


def streams(notebook: nbformat.NotebookNode) -> list[str]:
    return [
        "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        for cell in notebook.cells
        if cell.cell_type == "code"
    ]


def test_quickstart_trains_on_two_ranks_and_shows_what_each_did():
    notebook = execute("01_quickstart.ipynb")
    outputs = "\n".join(streams(notebook))
    assert "[rank0]: rank 0 of 2: 128 samples, first index 0" in outputs
    assert "[rank1]: rank 1 of 2: 128 samples, first index 1" in outputs
    assert "[rank1]: rank 1 epoch 4: last batch loss" in outputs
    learned = next(line for line in outputs.splitlines() if line.startswith("learned:"))
    weights = [float(w) for w in learned.split("[")[1].rstrip("]").split(",")]
    assert all(abs(w - target) < 0.5 for w, target in zip(weights, range(1, 9)))
    assert "ranks agree: True" in outputs
    assert (
        "caught: Rank 1 (pid" in outputs and "learning rate 10.0 is too large for rank 1" in outputs
    )

    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    panel = code[1].outputs
    assert code[1].source.endswith("configure()") and WIDGET_VIEW in panel[0].data
    # The training launch's dashboard, once the launch ended: its lasting record (HTML,
    # no widget left to go missing in the saved notebook), and as text the same table
    # (what frontends without HTML show): both ranks done, each with its logged loss.
    training = [o for o in code[3].outputs if o.output_type == "display_data"]
    assert len(training) == 1 and WIDGET_VIEW not in training[0].data
    assert "nl-record" in training[0].data["text/html"]
    record = training[0].data["text/plain"].splitlines()
    assert "finished after" in record[0]
    for rank, line in zip((0, 1), record[2:]):
        assert line.split()[:3] == [str(rank), "done", "cpu"] and "loss=" in line
        assert "100% training: 40/40" in line  # the plain tqdm bar, read from its text


def test_session_notebook_teaches_cell_by_cell_on_two_ranks():
    notebook = nbformat.read(EXAMPLES / "03_distributed_session.ipynb", as_version=4)
    execute_notebook(notebook, str(EXAMPLES), timeout=300)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    outputs = "\n".join(
        "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        for cell in code
    )
    assert "[rank0]: rank 0 of 2: local_rank 0, device cpu, backend gloo" in outputs
    assert "[rank1]: rank 1 holds [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]" in outputs
    assert "[rank0]: rank 0: my partial sum 30, after all_reduce 66" in outputs
    assert "[rank1]: rank 1: my partial sum 36, after all_reduce 66" in outputs
    before = [
        line.split(": ", 2)[2] for line in outputs.splitlines() if "before sync, rank" in line
    ]
    after = [line.split(": ", 2)[2] for line in outputs.splitlines() if "after sync,  rank" in line]
    assert len(before) == len(after) == 2 and before[0] != before[1] and after[0] == after[1]
    assert outputs.count("synced gradient is the mean of the local ones: True") == 2
    assert "ranks agree after the step: True" in outputs
    assert "[rank1]: rank 1: output torch.bfloat16, weights torch.float32" in outputs
    errors = [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert [e.ename for e in errors] == ["RankFailedError[ValueError]"]
    assert "raised ValueError: rank 1 found a bad batch" in errors[0].evalue
    assert ", line 3, in <module>" in errors[0].evalue
    assert "[rank0]: rank 0 still has its model (Linear) and all_reduce works: 2" in outputs


def test_big_model_notebook_runs_a_model_larger_than_its_budget_and_draws_the_plan():
    notebook = execute("05_big_model_inference.ipynb")
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    outputs = "\n".join(streams(notebook))
    assert "weights on meta" in outputs
    assert "same logits as the whole model: True" in outputs and "same tokens: True" in outputs
    assert "lm head still tied: True" in outputs
    plan = next(o for o in code[2].outputs if o.output_type == "execute_result")
    assert "nl-device-map" in plan.data["text/html"] and "&#9733;" in plan.data["text/html"]
    drawn = next(o for o in code[3].outputs if o.output_type == "display_data")
    assert "disk" in drawn.data["text/html"] and drawn.data["text/plain"].startswith("Device map:")
    assert "activations (traced)" in outputs
    assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]


def test_lora_notebook_fine_tunes_on_two_ranks_with_loss_curve_memory_and_adapter():
    notebook = execute("06_lora_fine_tuning.ipynb")
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert "trainable params:" in streams(notebook)[0]
    training = [o for o in code[1].outputs if o.output_type == "display_data"]
    assert len(training) == 1
    shown = training[0].data["text/html"]
    assert "nl-record" in shown and "<svg" in shown and "loss" in shown  # the curves
    assert ">peak memory</th>" in shown and shown.count('class="nl-memory"') == 2
    lines = streams(notebook)[2].splitlines()
    first, last = (float(x) for x in lines[0].removeprefix("loss: ").split(" -> "))
    assert last < first
    assert lines[1].startswith("rank 0: peak rss ") and lines[2].startswith("rank 1: peak rss ")
    assert "kB train" in lines[3]
    assert streams(notebook)[3].splitlines() == [
        "['README.md', 'adapter_config.json', 'adapter_model.safetensors']",
        "merged model gives the same outputs: True LlamaForCausalLM",
    ]
