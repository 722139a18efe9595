"""The course in examples/course runs top to bottom in a real kernel and shows what it teaches.

Each notebook is checked for its lesson: the values, shapes and verdicts the rank inspector
drew (read from its plain-text twin, and its HTML where the picture matters), not only for
the absence of errors. Error messages are checked loosely: the rank, the exception type.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = [pytest.mark.kernel, pytest.mark.slow]
COURSE = Path(__file__).resolve().parent.parent / "examples" / "course"
NOTEBOOKS = sorted(p.name for p in COURSE.glob("*.ipynb"))


def execute(name: str) -> list[nbformat.NotebookNode]:
    notebook = nbformat.read(COURSE / name, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(COURSE)}}).execute()
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def text(cells: list[nbformat.NotebookNode]) -> str:
    return "\n".join(o.get("text", "") for c in cells for o in c.outputs if o.output_type == "stream")


def drawings(cells: list[nbformat.NotebookNode]) -> list[dict[str, tuple[str, dict[int, str]]]]:
    """Each inspector output, in order: {"[stage: ]name": (verdict, {rank: line})}."""
    found = []
    for cell in cells:
        for output in cell.outputs:
            if output.output_type != "display_data" or "notebook-launcher-inspector" not in output.data.get("text/html", ""):
                continue
            drawing: dict[str, tuple[str, dict[int, str]]] = {}
            key = ""
            for line in output.data["text/plain"].splitlines():
                ranked = re.match(r"  rank (\d+): (.*)", line)
                if ranked:
                    drawing[key][1][int(ranked[1])] = ranked[2]
                else:
                    key, words = line.rsplit(": ", 1)
                    drawing[key] = (words, {})
            found.append(drawing)
    return found


def errors(cells: list[nbformat.NotebookNode]) -> list[nbformat.NotebookNode]:
    return [o for c in cells for o in c.outputs if o.output_type == "error"]


def test_every_notebook_is_one_session_with_a_colab_badge_and_a_guarded_install():
    assert len(NOTEBOOKS) == 7
    for name in NOTEBOOKS:
        notebook = nbformat.read(COURSE / name, as_version=4)
        first = notebook.cells[0]
        assert first.cell_type == "markdown" and "colab.research.google.com/github/" in first.source
        assert first.source.count(f"/blob/main/examples/course/{name})") == 1
        install = notebook.cells[1].source
        assert 'if "google.colab" in sys.modules:' in install and "%pip install -q notebook-launcher" in install
        sources = [c.source for c in notebook.cells if c.cell_type == "code"]
        assert sum("%distributed start" in s for s in sources) == 1 and sources[-1] == "%distributed stop"
        assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code")  # committed stripped
        assert "-n 2 --hardware cpu" in "".join(sources)
    json.loads((COURSE / NOTEBOOKS[0]).read_text())  # plain JSON, readable by every frontend


def test_01_processes_and_ranks():
    cells = execute("01_processes_and_ranks.ipynb")
    out = text(cells)
    assert "[rank0]: I am rank 0 of 2" in out and "[rank1]: I am rank 1 of 2" in out
    ranks, secret, greeting = drawings(cells)
    assert ranks["rank"] == ("differs across ranks (2 different values)", {0: "int 0", 1: "int 1"})
    assert ranks["world_size"][0] == "equal on every rank (2)"
    assert secret["secret"][0] == "equal where defined; missing on rank 0"
    assert secret["secret"][1][1] == "int 42" and "not defined" in secret["secret"][1][0]
    assert greeting["greeting"][1] == {0: "str hello from rank 0", 1: "str hello from rank 1"}
    assert "in the notebook: hello\n" in out
    assert errors(cells) == []


def test_02_sharding_data():
    cells = execute("02_sharding_data.ipynb")
    shard, block, indices = drawings(cells)
    assert shard["shard"][1][0].endswith("(5,) on cpu = [0, 2, 4, 6, 8]; min 0, max 8, mean 4")
    assert shard["shard"][1][1].startswith("Tensor float32 (5,) on cpu = [1, 3, 5, 7, 9]")
    assert "= [5, 6, 7, 8, 9]" in block["block"][1][1]
    sums = [float(block["shard_sum"][1][r].split()[1]) for r in (0, 1)]
    assert sums == [10.0, 35.0] and "sums to 45.0" in text(cells)
    assert indices["indices"][1] == {0: "list [0, 2, 4, 6, 8, 10]", 1: "list [1, 3, 5, 7, 9, 0]"}
    assert errors(cells) == []


def test_03_collectives_are_drawn_before_and_after():
    cells = execute("03_collectives.ipynb")
    reduce, broadcast, gather, scatter, heat = drawings(cells)
    assert reduce["before the cell: x"][0].startswith("differs")
    after = reduce["after the cell: x"]
    assert after[0] == "equal on every rank (2)"  # and equal to the sum of the two
    assert all("= [10, 12, 14, 16]" in line for line in after[1].values())
    assert broadcast["before the cell: y"][1][0].endswith("= [0, 0, 0]; min 0, max 0, mean 0")
    assert broadcast["after the cell: y"][0] == "equal on every rank (2)"
    assert "= [1, 1, 1]" in broadcast["after the cell: y"][1][0]
    assert gather["before the cell: gathered"][0] == "not defined on any rank shown"
    assert gather["after the cell: gathered"][0] == "equal on every rank (2)"
    assert "(4,) on cpu = [0, 0.5, 1, 1.5]" in gather["after the cell: gathered"][1][1]
    # reduce_scatter: each rank its own half of the sum [10, 12, 14, 16]
    assert scatter["after the cell: mine"][0].startswith("differs")
    assert "= [10, 12]" in scatter["after the cell: mine"][1][0]
    assert "= [14, 16]" in scatter["after the cell: mine"][1][1]
    assert heat["after the cell: m"][0] == "equal on every rank (2)"
    html = cells[-2].outputs[0].data["text/html"]  # the MAX all_reduce, drawn as heatmaps
    assert html.count('src="data:image/svg+xml;base64,') == 4 and html.count('data-equal="true"') == 1
    assert errors(cells) == []


def test_04_ddp_gradients_are_equal_after_the_sync():
    cells = execute("04_ddp.ipynb")
    local, by_hand, ddp, accelerated = drawings(cells)
    assert local["model.weight"][0] == "equal on every rank (2)"  # same seed, same start
    assert local["model.weight.grad"][0].startswith("differs")  # each rank its own batch
    assert by_hand["before the cell: model.weight.grad"][0].startswith("differs")
    assert by_hand["after the cell: model.weight.grad"][0] == "equal on every rank (2)"
    assert ddp["model.weight.grad"] == by_hand["after the cell: model.weight.grad"]
    assert accelerated["grad"] == by_hand["after the cell: model.weight.grad"]
    assert accelerated["weight"][0] == "equal on every rank (2)"
    out = text(cells)
    assert out.count("DDP's gradient equals the hand-made average: True") == 2
    assert out.count("the Accelerator's gradient equals the hand-made average: True") == 2
    assert errors(cells) == []


def test_05_accumulation_and_precision():
    cells = execute("05_accumulation_and_precision.ipynb")
    local, synced, precision = drawings(cells)
    assert local["grad"][0].startswith("differs")
    assert synced["after the cell: grad"][0] == "equal on every rank (2)"
    assert text(cells).count("two micro-batches of 4 == one batch of 8: True") == 2
    assert "float32 (4, 1)" in precision["full"][1][0] and "bfloat16 (4, 1)" in precision["half"][1][0]
    error = float(precision["error"][1][0].split()[1])
    assert 0 < error < 0.1  # bfloat16 keeps about three significant digits
    assert "1e-8 in float16: 0.0, scaled by 65536 first: 1e-08" in text(cells)
    assert errors(cells) == []


def test_06_fsdp_shards_each_parameter_across_the_ranks():
    cells = execute("06_fsdp.ipynb")
    shards, memory, step = drawings(cells)
    weight = shards["model.0.weight"]
    assert weight[0].startswith("differs")  # different rows on each rank
    for line in weight[1].values():
        assert "DTensor float32 (8, 8) on cpu, local shard of (16, 8) (Shard(dim=0))" in line
    full = int(memory["full_bytes"][1][0].split()[1])
    mine = [int(memory["my_bytes"][1][r].split()[1]) for r in (0, 1)]
    assert full == (8 * 16 + 16 + 16 * 4 + 4) * 4 and sum(mine) == full and max(mine) < full * 0.6
    assert "(8, 8)" in step["grad_shard"][1][0] and step["grad_shard"][0].startswith("differs")
    assert step["weight"][0] == "equal on every rank (2)" and "(16, 8)" in step["weight"][1][1]
    assert errors(cells) == []


def test_07_failures_are_reported_and_the_session_recovers():
    cells = execute("07_when_things_go_wrong.ipynb")
    raised, interrupted, killed = errors(cells)
    assert "ValueError" in raised.ename and "rank 1" in raised.evalue.lower()
    assert "rank 1 found a bad batch" in raised.evalue
    assert interrupted.ename == "KeyboardInterrupt"
    assert "RankFailed" in killed.ename and "rank 1" in killed.evalue.lower()
    assert "SIGKILL" in killed.evalue or "signal 9" in killed.evalue
    ok, after, restarted = drawings(cells)
    assert ok["ok"][0] == "equal on every rank (2)"
    assert ok["ok"][1][0].endswith("(1,) on cpu = [2]")  # all_reduce works again after the failure
    assert after["after"][0] == "equal on every rank (2)" and after["after"][1][1].endswith("= [1]")
    assert restarted["rank"][0].startswith("differs")
    assert "not defined" in restarted["ok"][1][0]  # new ranks: the old names are gone
