"""A dispatched model when a forward is stopped or fails, what it owns and gives back, what
its outputs may alias, and where its inputs and outputs go on one device. Memory and
descriptors are counted in a process per case (tests/support/big_model_scripts/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from notebook_launcher import big_modeling as bm
from tests.support.big_models import TinyLM

IDS = torch.tensor([[1, 5, 7, 2, 9], [3, 3, 8, 0, 4]])

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "support" / "big_model_scripts"


def run_script(*arguments: object) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, *map(str, arguments)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow(
    reason="a process of its own dispatches a model and stops or fails its forward, per case"
)
@pytest.mark.parametrize("error", ["KeyboardInterrupt", "ValueError"])
@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_a_forward_stopped_or_failing_inside_a_block_leaves_nothing_behind(tmp_path, kind, error):
    result = run_script(SCRIPTS / "stop_and_fail.py", kind, error, tmp_path / "off")
    assert result["caught"] == error
    # Every slot holds its home tensor again (offloaded weights: the meta placeholder).
    assert result["slots_not_home"] == []
    # No block lent and none fetched ahead: after the error, and between good forwards.
    assert result["after_error"] == [0, 0] and result["between_forwards"] == [0, 0]
    assert result["after_next"] == [0, 0]
    # During a forward: the block running, and at most one fetched ahead.
    for lent, ahead in result["during_failed"] + result["during_next"]:
        assert lent == 1 and ahead <= 1, result
    assert result["outputs_right"] == [True, True, True]
    # Memory back to its steady state: less than one block more than before the error.
    assert result["grown"] < result["block_bytes"], result


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resources")
    torch.manual_seed(0)
    state = {k: v for k, v in TinyLM().state_dict().items() if k != "head.weight"}
    save_file(state, root / "good.safetensors")
    state["embed.weight"] = torch.zeros(3, 3)  # read after the blocks were written to disk
    save_file(state, root / "bad.safetensors")
    return root


@pytest.mark.slow(reason="a process of its own dispatches a model to disk, per case")
@pytest.mark.parametrize("case", ["remove_hooks", "collected"])
def test_remove_hooks_or_collecting_the_model_closes_the_folder_and_ends_the_thread(
    checkpoints, tmp_path, case
):
    result = run_script(
        SCRIPTS / "resources.py", case, checkpoints / "good.safetensors", tmp_path / "off"
    )
    assert result["while_used"]["descriptors"] >= 1 and result["while_used"]["threads"] == 1
    assert result["descriptors"] == [] and result["threads"] == []
    assert result["deleted_still_open"] == []  # so deleting the folder frees its space


@pytest.mark.slow(reason="a process of its own writes, fails and cleans an offloaded checkpoint")
def test_a_failed_load_closes_and_removes_what_it_wrote(checkpoints, tmp_path):
    result = run_script(
        SCRIPTS / "resources.py",
        "failed_load",
        checkpoints / "good.safetensors",
        tmp_path / "off",
        checkpoints / "bad.safetensors",
    )
    assert "'embed.weight' has shape [3, 3]" in result["error"]
    assert result["descriptors"] == [] and result["threads"] == []
    assert result["left_in_folder"] in (None, [])


class Holds(torch.nn.Module):
    """A block whose output includes a view of its own weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.weight.T @ self.weight, self.weight[0]


class Viewer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Holds() for _ in range(4))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        views = []
        for block in self.blocks:
            x, view = block(x)
            views.append(view)
        return [x, *views]


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_an_output_viewing_a_weight_is_never_overwritten_by_later_forwards(tmp_path, kind):
    torch.manual_seed(0)
    model = Viewer().eval()
    x = torch.randn(2, 8)
    rows = [block.weight[0].detach().clone() for block in model.blocks]
    if kind == "cpu":
        bm.cpu_offload(model, execution_device="cpu")
    else:
        bm.disk_offload(model, tmp_path)
    with torch.no_grad():
        first = model(x)
        for _ in range(3):
            model(torch.randn(2, 8))
    for view, row in zip(first[1:], rows):
        assert torch.equal(view, row)
    bm.remove_hooks(model)


def test_on_one_device_inputs_go_to_the_execution_device_and_skip_keys_stay():
    """The meta device stands in for a GPU: moving a tensor there is real, and costs nothing."""
    from notebook_launcher.big_modeling.hooks import attach_hooks

    seen: dict[str, str] = {}

    class Looks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)

        def forward(self, x: torch.Tensor, cache: torch.Tensor, mask: torch.Tensor) -> None:
            seen.update(x=x.device.type, cache=cache.device.type, mask=mask.device.type)

    module = Looks()
    hooks = attach_hooks(module, torch.device("meta"), skip_keys=frozenset({"cache"}))
    module(torch.ones(2), cache=torch.ones(2), mask=torch.ones(2))
    hooks.remove()
    assert seen == {"x": "meta", "cache": "cpu", "mask": "meta"}


class WideEmbedding(torch.nn.Module):
    """The embeddings outweigh the whole stack of blocks, which the model iterates."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(4096, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        return hidden


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_a_module_list_lighter_than_the_largest_piece_is_still_lent_block_by_block(tmp_path, kind):
    torch.manual_seed(0)
    model = WideEmbedding().eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = model(ids)
    if kind == "cpu":
        bm.cpu_offload(model, execution_device="cpu")
    else:
        bm.disk_offload(model, tmp_path)
    with torch.no_grad():
        assert torch.equal(model(ids), expected)


def test_remove_hooks_gives_cpu_offloaded_weights_back_on_the_cpu():
    torch.manual_seed(0)
    model = TinyLM().eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        expected = model(IDS)
    bm.cpu_offload(model, execution_device="cpu")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    bm.remove_hooks(model)
    for name, param in model.named_parameters():
        assert param.device.type == "cpu" and torch.equal(param, before[name]), name
    assert model.head.weight is model.embed.weight  # still tied
    with torch.no_grad():
        assert torch.equal(model(IDS), expected)


def test_remove_hooks_leaves_disk_weights_on_meta_and_a_forward_names_them(tmp_path):
    from notebook_launcher.errors import BigModelError

    torch.manual_seed(0)
    model = TinyLM().eval()
    state = model.state_dict()
    with torch.no_grad():
        expected = model(IDS)
    bm.disk_offload(model, tmp_path / "off")
    bm.remove_hooks(model)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    with pytest.raises(
        BigModelError,
        match=r"TinyLM cannot run: 'embed\.weight', .* and \d+ more are on the meta device "
        r"\(no data\): remove_hooks\(model\) leaves the weights offloaded to disk there\. "
        r"Load them again .*remove_hooks\(model, restore=True\)",
    ):
        with torch.no_grad():
            model(IDS)
    # Loaded again, the model runs, and the guard is gone.
    save_file({k: v for k, v in state.items() if k != "head.weight"}, tmp_path / "w.safetensors")
    bm.load_checkpoint_in_model(model, tmp_path / "w.safetensors")
    with torch.no_grad():
        assert torch.equal(model(IDS), expected)
    assert "forward" not in model.__dict__


def test_remove_hooks_restore_reads_disk_weights_back_into_cpu_memory(tmp_path):
    torch.manual_seed(0)
    model = TinyLM().eval()
    with torch.no_grad():
        expected = model(IDS)
    bm.disk_offload(model, tmp_path / "off")
    with torch.no_grad():
        assert torch.equal(model(IDS), expected)
    bm.remove_hooks(model, restore=True)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model.head.weight is model.embed.weight
    assert "forward" not in model.__dict__
    # Weights of their own, not views of a file: the folder may go.
    for path in (tmp_path / "off").iterdir():
        path.unlink()
    with torch.no_grad():
        assert torch.equal(model(IDS), expected)
        assert torch.equal(model(IDS), expected)
