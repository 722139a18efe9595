"""The course in examples/course runs top to bottom in a real kernel and shows what it teaches.

Each notebook is checked for its lesson: the values, shapes and verdicts the rank inspector
drew (read from its plain-text twin, and its HTML where the picture matters), and the numbers
its text claims, not only the absence of errors. Error messages are checked loosely: the rank,
the exception type. The notebooks share one kernel (cleared between them), so torch is
imported once.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from tests.support.kernel_driver import started_kernel

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parent.parent
COURSE = ROOT / "examples" / "course"
EXECUTED = ROOT / "docs" / "course"
NOTEBOOKS = sorted(p.name for p in COURSE.glob("*.ipynb"))
WITHOUT_SESSION = {"11_end_to_end.ipynb"}  # a launch, not a session


@pytest.fixture(scope="module")
def kernel() -> Iterator[KernelManager]:
    manager = started_kernel(cwd=str(COURSE))
    client = manager.blocking_client()
    # torch's optimizers import torch._dynamo on first use, seconds on a busy machine; once in
    # the kernel, the forked ranks of every notebook start with it.
    client.execute_interactive("import torch, torch._dynamo", timeout=300)
    client.stop_channels()
    try:
        yield manager
    finally:
        manager.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def run(kernel: KernelManager):
    def execute(name: str) -> list[nbformat.NotebookNode]:
        notebook = nbformat.read(COURSE / name, as_version=4)
        # One kernel for the whole course: each notebook starts from an empty namespace.
        notebook.cells.insert(0, nbformat.v4.new_code_cell("%reset -f"))
        NotebookClient(
            notebook, km=kernel, timeout=300, resources={"metadata": {"path": str(COURSE)}}
        ).execute()
        return [cell for cell in notebook.cells[1:] if cell.cell_type == "code"]

    return execute


def text(cells: list[nbformat.NotebookNode]) -> str:
    return "\n".join(
        o.get("text", "") for c in cells for o in c.outputs if o.output_type == "stream"
    )


def drawings(
    cells: list[nbformat.NotebookNode], kind: str = "inspector"
) -> list[dict[str, tuple[str, dict[int, str]]]]:
    """Each inspector (or ownership) output, in order: {"[stage: ]name": (verdict, {rank: line})}."""
    found = []
    for cell in cells:
        for output in cell.outputs:
            if output.output_type not in ("display_data", "execute_result"):
                continue
            if f"notebook-launcher-{kind}" not in output.data.get("text/html", ""):
                continue
            drawing: dict[str, tuple[str, dict[int, str]]] = {}
            key = ""
            for line in output.data["text/plain"].splitlines():
                ranked = re.match(r"  rank (\d+): (.*)", line)
                if ranked:
                    drawing[key][1][int(ranked[1])] = ranked[2]
                else:  # "[stage: ]name: verdict", where a verdict may hold ": " too
                    head = re.match(
                        r"(.*?): ((?:equal|differs|sharded|per rank|defined|missing|not defined|one rank|owned).*)",
                        line,
                    )
                    assert head, line
                    key, words = head[1], head[2]
                    drawing[key] = (words, {})
            found.append(drawing)
    return found


def html_of(cells: list[nbformat.NotebookNode], marker: str) -> list[str]:
    return [
        o.data["text/html"]
        for c in cells
        for o in c.outputs
        if o.output_type in ("display_data", "execute_result")
        and marker in o.data.get("text/html", "")
    ]


def pictures(page: str) -> list[str]:
    return [
        base64.b64decode(p).decode()
        for p in re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', page)
    ]


def errors(cells: list[nbformat.NotebookNode]) -> list[nbformat.NotebookNode]:
    return [o for c in cells for o in c.outputs if o.output_type == "error"]


def test_every_notebook_has_a_colab_badge_a_guarded_install_and_a_picture():
    assert len(NOTEBOOKS) == 14
    for name in NOTEBOOKS:
        notebook = nbformat.read(COURSE / name, as_version=4)
        first = notebook.cells[0]
        assert first.cell_type == "markdown" and "colab.research.google.com/github/" in first.source
        assert first.source.count(f"/blob/main/examples/course/{name})") == 1
        install = notebook.cells[1].source
        assert 'if importlib.util.find_spec("notebook_launcher") is None:' in install
        assert "%pip install -q notebook-launcher" in install
        sources = [c.source for c in notebook.cells if c.cell_type == "code"]
        assert all(
            not c.get("outputs") for c in notebook.cells if c.cell_type == "code"
        )  # committed stripped
        drawn = ("show", "Ownership", "StackedBars", "Timeline", "Measured", "notebook_launcher(")
        assert any(word in "".join(sources) for word in drawn), f"{name} draws no picture"
        if name in WITHOUT_SESSION:
            continue
        assert (
            sum("%distributed start" in s for s in sources) == 1
            and sources[-1] == "%distributed stop"
        )
        assert "-n 2 --hardware cpu" in "".join(sources)
    json.loads((COURSE / NOTEBOOKS[0]).read_text())  # plain JSON, readable by every frontend


def test_the_failures_notebook_installs_py_spy_wherever_its_program_is_missing():
    install = nbformat.read(COURSE / "07_when_things_go_wrong.ipynb", as_version=4).cells[1].source
    lines = install.splitlines()
    guard = next(i for i, line in enumerate(lines) if line.startswith('if shutil.which("py-spy"'))
    assert lines[guard + 1] == "    %pip install -q py-spy"  # not under the package's own guard
    assert "notebook-launcher py-spy" not in install  # once skipped wherever the package imported


def test_the_install_cell_installs_nothing_where_the_package_is_importable(kernel):
    notebook = nbformat.read(COURSE / NOTEBOOKS[0], as_version=4)
    notebook.cells = [notebook.cells[1]]
    NotebookClient(notebook, km=kernel, timeout=60).execute()
    assert notebook.cells[0].outputs == []  # no pip run, no output


def test_the_docs_hold_every_notebook_executed_from_its_current_source():
    for name in NOTEBOOKS:
        source = nbformat.read(COURSE / name, as_version=4)
        executed = nbformat.read(EXECUTED / name, as_version=4)
        assert [c.source for c in executed.cells] == [c.source for c in source.cells], (
            f"docs/course/{name} is stale: run `make course`"
        )
        code = [c for c in executed.cells if c.cell_type == "code"]
        assert all(c.execution_count for c in code[2:])
        assert errors(code) == [] or name.startswith("07")  # 07 fails on purpose
        assert any(c.outputs for c in code)


def test_01_processes_and_ranks(run):
    cells = run("01_processes_and_ranks.ipynb")
    out = text(cells)
    assert "[rank0]: I am rank 0 of 2" in out and "[rank1]: I am rank 1 of 2" in out
    ranks, noise, secret, greeting = drawings(cells)
    assert ranks["rank"] == ("differs across ranks (2 different values)", {0: "int 0", 1: "int 1"})
    assert ranks["world_size"][0] == "equal on every rank (2)"
    # Two ranks, two values, no majority: as the text says, no card is outlined.
    page = html_of(cells, 'data-name="rank"')[0]
    assert 'data-odd="true"' not in page
    assert (
        noise["noise"][0].startswith("differs")
        and noise["same_seed"][0] == "equal on every rank (2)"
    )
    noise_page = html_of(cells, 'data-name="noise"')[0]
    assert noise_page.count('alt="heatmap of') == 4 and noise_page.count('class="nl-legend"') == 2
    # Missing is its own state, not "differs": one brown badge, rank 0's card outlined.
    assert secret["secret"][0] == "defined on rank 1 only; missing on rank 0"
    secret_page = html_of(cells, 'data-name="secret"')[0]
    assert 'data-state="missing"' in secret_page and "≠" not in secret_page
    assert 'data-rank="0" data-odd="true"' in secret_page
    assert secret["secret"][1][1] == "int 42" and "not defined" in secret["secret"][1][0]
    assert greeting["greeting"][1] == {0: "str hello from rank 0", 1: "str hello from rank 1"}
    assert "in the notebook: hello\n" in out
    assert errors(cells) == []


def test_02_sharding_data(run):
    cells = run("02_sharding_data.ipynb")
    shard, block, indices = drawings(cells)
    # Each rank's own shard: different by design, said in a neutral badge.
    assert shard["shard"][0] == "per rank, by design (2 different values)"
    assert 'data-state="per-rank"' in html_of(cells, 'data-name="shard"')[0]
    assert shard["shard"][1][0].endswith("(5,) on cpu = [0, 2, 4, 6, 8]; min 0, max 8, mean 4")
    assert shard["shard"][1][1].startswith("Tensor float32 (5,) on cpu = [1, 3, 5, 7, 9]")
    assert "= [5, 6, 7, 8, 9]" in block["block"][1][1]
    sums = [float(block["shard_sum"][1][r].split()[1]) for r in (0, 1)]
    assert sums == [10.0, 35.0] and "sums to 45.0" in text(cells)
    assert indices["indices"][1] == {0: "list [0, 2, 4, 6, 8, 10]", 1: "list [1, 3, 5, 7, 9, 0]"}
    strided, contiguous, sampler = drawings(cells, "ownership")
    assert strided["data, strided shards (10,)"][1] == {
        0: "elements 0, 2, 4, 6, 8 (5 of 10 elements)",
        1: "elements 1, 3, 5, 7, 9 (5 of 10 elements)",
    }
    assert contiguous["data, contiguous shards (10,)"][1] == {
        0: "elements 0-4 (5 of 10 elements)",
        1: "elements 5-9 (5 of 10 elements)",
    }
    # Sample 0 is held by both ranks: the padding counts it twice.
    words, held = sampler["range(11) under DistributedSampler (11,)"]
    assert words == "owned by rank; 1 held by several ranks" and "0-1" in held[1]
    out = text(cells)
    orders = dict(re.findall(r"\[rank(\d)\]: (epoch 0: .*)", out))
    for line in orders.values():
        first, again, later = re.findall(r"\[[\d, ]+\]", line)
        assert first == again != later  # without set_epoch the same order; with it another
    assert "epoch 1 covers every sample once: True" in out
    assert errors(cells) == []


def test_03_collectives_are_drawn_before_and_after(run):
    cells = run("03_collectives.ipynb")
    reduce, broadcast, gather, scatter, identity, heat = drawings(cells)
    assert reduce["before the cell: x"][0].startswith("differs")
    after = reduce["after the cell: x"]
    assert after[0] == "equal on every rank (2)"  # and equal to the sum of the two
    assert all("= [10, 12, 14, 16]" in line for line in after[1].values())
    assert broadcast["before the cell: y"][1][0].endswith("= [0, 0, 0]; min 0, max 0, mean 0")
    assert broadcast["after the cell: y"][0] == "equal on every rank (2)"
    assert "= [1, 1, 1]" in broadcast["after the cell: y"][1][0]
    assert gather["before the cell: gathered"][0] == "not defined on any rank shown"
    assert 'data-state="missing"' in html_of(cells, 'data-name="gathered"')[0]
    assert gather["after the cell: gathered"][0] == "equal on every rank (2)"
    assert "(4,) on cpu = [0, 0.5, 1, 1.5]" in gather["after the cell: gathered"][1][1]
    # reduce_scatter: each rank its own half of the sum [10, 12, 14, 16]
    assert scatter["after the cell: mine"][0] == "per rank, by design (2 different values)"
    assert "= [10, 12]" in scatter["after the cell: mine"][1][0]
    assert "= [14, 16]" in scatter["after the cell: mine"][1][1]
    # reduce_scatter then all_gather, from the same tensors, is the all_reduce
    assert text(cells).count("reduce_scatter then all_gather equals all_reduce: True") == 2
    assert (
        identity["rebuilt"] == identity["summed"]
        and "= [10, 12, 14, 16]" in identity["rebuilt"][1][0]
    )
    assert heat["after the cell: m"][0] == "equal on every rank (2)"
    page = cells[-2].outputs[0].data["text/html"]  # the MAX all_reduce, drawn as heatmaps
    assert page.count('alt="heatmap of') == 4 and page.count('data-equal="true"') == 1
    assert errors(cells) == []


def test_04_ddp_gradients_are_equal_after_the_sync(run):
    cells = run("04_ddp.ipynb")
    local, by_hand, broadcast, ddp, accelerated = drawings(cells)
    assert local["model.weight"][0] == "equal on every rank (2)"  # same seed, same start
    assert local["model.weight.grad"][0].startswith("differs")  # each rank its own batch
    # All negative gradients: a darker colour is a larger magnitude, on one scale across ranks.
    page = html_of(cells, 'data-name="model.weight.grad"')[0]
    assert "white is 0" in page
    assert by_hand["before the cell: model.weight.grad"][0].startswith("differs")
    assert by_hand["after the cell: model.weight.grad"][0] == "equal on every rank (2)"
    out = text(cells)
    assert out.count("one process on all 16 samples, mean loss, gives the average: True") == 2
    assert (
        out.count("the average of the ranks' gradients is 0.5000 times the global batch's gradient")
        == 2
    )
    # DDP broadcasts rank 0's weights when it is built: no common seed needed.
    assert broadcast["before_ddp"][0].startswith("differs")
    assert broadcast["after_ddp"][0] == "equal on every rank (2)"
    assert broadcast["after_ddp"][1][1] == broadcast["before_ddp"][1][0]
    assert ddp["model.weight.grad"] == by_hand["after the cell: model.weight.grad"]
    assert out.count("DDP's gradient equals the hand-made average: True") == 2
    assert out.count("DDP: 1 all_reduce call(s) for 2 parameters, [4] numbers per call") == 2
    assert accelerated["grad"] == by_hand["after the cell: model.weight.grad"]
    assert accelerated["weight"][0] == "equal on every rank (2)"
    assert out.count("the Accelerator's gradient equals the hand-made average: True") == 2
    assert errors(cells) == []


def test_05_accumulation_and_precision(run):
    cells = run("05_accumulation_and_precision.ipynb")
    local, synced, precision, communicated = drawings(cells)
    out = text(cells)
    assert out.count("gradients synchronised after micro-batch 1: False") == 2
    assert local["grad"][0].startswith("per rank, by design")  # no_sync: meant to differ
    assert synced["after the cell: grad"][0] == "equal on every rank (2)"
    assert out.count("two micro-batches of 4 == one batch of 8: True") == 2
    # bfloat16 keeps float32's range: 1e-8 survives in it and is lost in float16.
    tiny = re.search(r"1e-8 in bfloat16: (\S+); in float16: (\S+)", out)
    assert tiny and float(tiny[1]) == pytest.approx(1e-8, rel=0.01) and float(tiny[2]) == 0.0
    ranges = {k: float(v) for k, v in re.findall(r"torch\.(\w+) +largest (\S+),", out)}
    assert (
        ranges["bfloat16"] == pytest.approx(ranges["float32"], rel=0.01)
        and ranges["float16"] == 6.55e4
    )
    assert (
        "float32 (4, 1)" in precision["full"][1][0] and "bfloat16 (4, 1)" in precision["half"][1][0]
    )
    error = float(precision["error"][1][0].split()[1])
    assert "float32 (4, 1)" in precision["rounding"][1][0]
    assert 0 < error < 0.1  # bfloat16 keeps about 2.4 significant digits
    assert "torch.bfloat16" in out and "2.4 digits" in out
    assert re.search(
        r"torch\.float16 +largest 6\.55e\+04, smallest normal 6\.1e-05, smallest subnormal 6e-08",
        out,
    )
    assert "1e-8 in float16: 0.0, scaled by 65536 first: 1e-08" in out
    # Reducing in bfloat16: equal on every rank, and off from float32 in the third digit.
    assert communicated["grad_bf16"][0] == "equal on every rank (2)"
    assert (
        communicated["grad_fp32"][0] == "equal on every rank (2)"
        and communicated["grad_bf16"] != communicated["grad_fp32"]
    )
    difference = float(communicated["difference"][1][0].split()[1])
    assert 0 < difference < 0.1
    assert errors(cells) == []


def test_06_fsdp_shards_each_parameter_across_the_ranks(run):
    cells = run("06_fsdp.ipynb")
    shards, memory, step = drawings(cells)
    weight = shards["model.0.weight"]
    assert weight[0] == "sharded: rows 0-7 | 8-15"  # neutral: shards differ by design
    assert shards["model.2.bias"][0] == "sharded: elements 0-1 | 2-3"
    for line in weight[1].values():
        assert "DTensor float32 (8, 8) on cpu, local shard of (16, 8) (Shard(dim=0))" in line
    page = html_of(cells, 'data-name="model.0.weight"')[0]
    assert 'data-state="sharded"' in page and "≠" not in page and 'data-odd="true"' not in page
    # The whole weight, each element in its owner's colour, then each rank's block highlighted.
    assert page.count('class="nl-picture nl-ownership"') == 2 * (
        1 + 2
    )  # per name: the whole, then each rank
    whole = next(p for p in pictures(page) if 'fill="#009e73"' in p)
    assert whole.count('fill="#e69f00"') == whole.count('fill="#009e73"') == 64  # rank 0 and rank 1
    # The whole 16 x 8 and one rank's 8 x 8 part at the same cell size: the part is half as tall.
    sizes = dict(re.findall(r'alt="([^"]*)" width="\d+" height="(\d+)"', page))
    assert int(sizes["ownership of model.0.weight"]) == 2 * int(
        sizes["heatmap of model.0.weight on rank 0"]
    )
    full = int(memory["full_bytes"][1][0].split()[1])
    mine = [int(memory["my_bytes"][1][r].split()[1]) for r in (0, 1)]
    assert full == (8 * 16 + 16 + 16 * 4 + 4) * 4 and sum(mine) == full and max(mine) < full * 0.6
    out = text(cells)
    assert "rank 0: grad_shard equals rows 0-7 of the averaged full gradient: True" in out
    assert "rank 1: grad_shard equals rows 8-15 of the averaged full gradient: True" in out
    assert (
        step["grad_shard"][0] == "sharded: rows 0-7 | 8-15" and "(8, 8)" in step["grad_shard"][1][0]
    )
    assert step["weight_before"][0] == step["weight"][0] == "equal on every rank (2)"
    assert step["weight"][1][0] != step["weight_before"][1][0] and "(16, 8)" in step["weight"][1][1]
    # The step's change drawn on its own scale: what the before and after pictures cannot show.
    assert step["change"][0] == "equal on every rank (2)" and "(16, 8)" in step["change"][1][0]
    assert errors(cells) == []


def test_07_failures_are_reported_debugged_and_the_session_recovers(run):
    cells = run("07_when_things_go_wrong.ipynb")
    raised, interrupted, killed = errors(cells)
    assert "ValueError" in raised.ename and "rank 1" in raised.evalue.lower()
    assert "rank 1 found a bad batch" in raised.evalue
    assert interrupted.ename == "KeyboardInterrupt"
    assert "RankFailed" in killed.ename and "rank 1" in killed.evalue.lower()
    assert "SIGKILL" in killed.evalue or "signal 9" in killed.evalue
    out = text(cells)
    assert "the default process-group timeout: 0:30:00" in out
    # The mismatched collective hangs until the group's 2-second timeout. The barrier starts
    # both ranks together; one that a busy machine still held back past its peer's timeout
    # sees the peer close the connection instead.
    ended = {
        r: (float(s), why)
        for r, s, why in re.findall(r"\[rank(\d)\]: after (\d+\.\d) s: (.*)", out)
    }
    assert sorted(ended) == ["0", "1"], out
    timed_out = [r for r, (s, why) in ended.items() if why.startswith("Timed out waiting 2000ms")]
    assert timed_out and all(ended[r][0] >= 1.9 for r in timed_out), ended
    assert all(
        r in timed_out or "Connection closed by peer" in why for r, (_, why) in ended.items()
    )
    # With TORCH_DISTRIBUTED_DEBUG=DETAIL it fails at once, naming both collectives.
    assert "Op type: ALLREDUCEvs BROADCAST" in out and "Op type: BROADCASTvs ALLREDUCE" in out
    # py-spy shows rank 0's stack, stuck in recv from the notebook's cell.
    assert re.search(r"Thread \d+ .*\n\s+recv \(torch/distributed/distributed_c10d\.py:\d+\)", out)
    ok, after, restarted = drawings(cells)
    assert ok["ok"][0] == "equal on every rank (2)"
    assert ok["ok"][1][0].endswith("(1,) on cpu = [2]")  # all_reduce works again after the failure
    assert after["after"][0] == "equal on every rank (2)" and after["after"][1][1].endswith("= [1]")
    assert restarted["rank"][0].startswith("differs")
    assert "not defined" in restarted["ok"][1][0]  # new ranks: the old names are gone


def test_08_the_cost_of_communication(run):
    cells = run("08_cost_of_communication.ipynb")
    chart = [
        o
        for c in cells
        for o in c.outputs
        if "notebook-launcher-chart" in o.get("data", {}).get("text/html", "")
    ]
    text_twin = chart[0].data["text/plain"]
    for name in ("all_reduce", "reduce_scatter", "all_gather"):
        assert re.search(rf"  {name}: model alpha [\d.e-]+ s \+ beta [\d.e-]+ s/byte", text_twin)
    sizes = [int(v.replace(",", "")) for v in re.findall(r"    bytes ([\d,]+):", text_twin)]
    assert sizes[:8] == [4**k * 1024 for k in range(1, 8)] + [32 * 2**20] and len(sizes) == 24
    svg = pictures(chart[0].data["text/html"])[0]
    # Ticks and units on both axes: bytes below, seconds on the left.
    assert "4 KiB" in svg and "16 MiB" in svg and re.search(r">1 (ms|µs)<", svg)
    assert "bytes per call (log scale)" in svg and "seconds per call (log scale)" in svg
    out = text(cells)
    assert "20 calls per size" in out and "of the time is bytes" in out
    psi = 2 * (64 * 64 + 64)
    assert f"psi = {psi} parameters" in out
    assert f"DDP: [('all_reduce', {psi})]" in out
    fsdp = re.search(r"FSDP: (\[.*\])", out)[1]
    assert fsdp.count("'all_gather'") == 4 and fsdp.count("'reduce_scatter'") == 2
    assert "per rank and step: DDP 2 psi, FSDP 3 psi, ratio 1.5" in out
    assert errors(cells) == []


def test_09_memory_by_zero_stage_computed_then_measured(run):
    cells = run("09_memory_by_zero_stage.ipynb")
    out = text(cells)
    psi = 2 * (256 * 256 + 256)
    assert (
        f"DDP     {16 * psi:>9,} bytes per rank" in out
        and f"ZeRO-3  {8 * psi:>9,} bytes per rank" in out
    )
    for stage in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"):
        assert f"{stage}: measured equals computed on every rank: True" in out
    chart = next(
        o
        for c in cells
        for o in c.outputs
        if "notebook-launcher-chart" in o.get("data", {}).get("text/html", "")
    )
    bars = dict(re.findall(r"  (.+?): ([\d,]+) bytes", chart.data["text/plain"]))
    assert bars["ZeRO-1 rank 1 measured"] == f"{(4 + 4 + 4) * psi:,}"
    assert bars["ZeRO-2 computed"] == f"{(4 + 2 + 4) * psi:,}"
    # ZeRO-2 (FSDP2 keeping whole parameters from forward to backward), measured
    assert bars["ZeRO-2 rank 0 measured"] == f"{(4 + 2 + 4) * psi:,}"
    assert len(pictures(chart.data["text/html"])) == 1
    assert errors(cells) == []


def test_10_tensor_and_pipeline_parallelism(run):
    cells = run("10_tensor_and_pipeline_parallel.ipynb")
    out = text(cells)
    assert (
        out.count(
            "equals the unsplit model: True | collectives in the forward pass: {'all_reduce': 1}"
        )
        == 2
    )
    (weights,) = drawings(cells)
    assert weights["mlp.0.weight"][0] == "sharded: rows 0-3 | 4-7"  # column-parallel
    assert weights["mlp.2.weight"][0] == "sharded: columns 0-3 | 4-7"  # row-parallel
    assert "local shard of (4, 8) (Shard(dim=1))" in weights["mlp.2.weight"][1][1]
    assert (
        out.count("the pipeline's gradients equal the whole model's: True") == 8
    )  # 4 runs, 2 ranks
    timelines = [
        o
        for c in cells
        for o in c.outputs
        if "nl-timeline" in o.get("data", {}).get("text/html", "")
    ]
    assert len(timelines) == 3  # GPipe m=4, GPipe m=8, 1F1B m=8
    rows = [dict(re.findall(r"  (rank \d): ([FB\d ]+);", t.data["text/plain"])) for t in timelines]
    gpipe4 = "F1 F2 F3 F4 B4 B3 B2 B1"
    assert rows[0] == {"rank 0": gpipe4, "rank 1": gpipe4}
    assert rows[2]["rank 1"] == "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 F8 B8"
    svg = pictures(timelines[0].data["text/html"])[0]
    # A time axis, and every block labelled (rank 0's B1 too).
    assert "time since the first span (ms)" in svg
    assert all(f">{label}</text>" in svg for label in gpipe4.split())
    assert svg.count(">B1</text>") == 2
    out = text(cells)
    assert "GPipe, m=4: the textbook's idle (p-1)/(m+p-1) = 20%" in out
    assert "GPipe, m=8: the textbook's idle (p-1)/(m+p-1) = 11%" in out
    assert (
        "1F1B, m=8: the textbook's idle (p-1)/(m+p-1) = 11%; activations held at most: 2 and 1"
        in out
    )
    assert len(re.findall(r"rank \d: idle \d+% measured, \d+% in the replay", out)) == 6
    assert errors(cells) == []


def test_11_end_to_end_against_one_process(run):
    cells = run("11_end_to_end.ipynb")
    out = text(cells)
    assert "the same final weights: True" in out and "the same global losses: True" in out
    records = [o.data["text/html"] for o in cells[-1].outputs if "text/html" in o.get("data", {})]
    assert any(
        "faded dashed lines on a pale band: the previous launch in this kernel" in r
        for r in records
    )
    # One curve per rank of each rank's own loss; the global loss from rank 0 alone.
    page = next(r for r in records if "nl-plot" in r)
    assert "rank 1, this rank&#x27;s loss" in page or "rank 1, this rank's loss" in page
    assert "rank 1, global loss" not in page and "previous launch: rank 0, global loss" in page
    assert errors(cells) == []


def test_12_activations_and_recomputation(run):
    cells = run("12_activations_and_recomputation.ipynb")
    out = text(cells)
    for rank, batch in ((0, 64), (1, 128)):
        plain, checkpointed = 4 * batch * 2304 * 4, 4 * batch * 256 * 4
        assert (
            f"rank {rank}, batch {batch}: {plain:,} bytes saved for backward; "
            f"with checkpointing {checkpointed:,} (11%)" in out
        )
    saved = drawings(cells)[0]
    assert saved["saved_plain"][0].startswith("per rank, by design")
    assert out.count("same gradients: True") == 2
    ratios = [float(r) for r in re.findall(r"checkpointing \(x([\d.]+)\)", out)]
    assert len(ratios) == 2 and all(r == pytest.approx(27 / 23, rel=1e-3) for r in ratios)
    assert errors(cells) == []


def test_13_expert_parallelism_against_one_process(run):
    cells = run("13_expert_parallelism.ipynb")
    out = text(cells)
    assert out.count("the expert-parallel output equals one process's: True") == 2
    processed = [int(n) for n in re.findall(r"my expert processed (\d+) of the 12 tokens", out)]
    assert len(processed) == 2 and sum(processed) == 12  # every token went to exactly one expert
    counts = drawings(cells)[0]
    sent = [counts["send_counts"][1][r] for r in (0, 1)]
    assert all(line.startswith("Tensor int64 (2,)") for line in sent)
    assert errors(cells) == []


def test_14_ring_attention_equals_full_attention(run):
    cells = run("14_context_parallelism.ipynb")
    out = text(cells)
    assert out.count("equals full attention: True; sent 512 bytes of keys and values") == 2
    assert "positions 0-7" in out and "positions 8-15" in out
    shown = drawings(cells)[0]
    assert shown["bytes_sent"][0] == "equal on every rank (2)"
    assert errors(cells) == []
