"""Big models on small machines, with plain torch models: checkpoints of every layout loaded
across CPU and disk give the outputs of the model in one piece; tied weights stay tied; the
plan draws itself; every bad input gets one error that names it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from notebook_launcher import big_modeling as bm
from notebook_launcher.accelerator.model_files import write_model
from notebook_launcher.big_modeling import device_map as device_map_module
from notebook_launcher.big_modeling.sizes import parse_budget
from notebook_launcher.errors import (
    BigModelError,
    CheckpointMismatchError,
    DeviceMapError,
    OffloadFolderError,
)
from tests.support.big_models import TinyLM

ROOT = Path(__file__).resolve().parents[2]
IDS = torch.tensor([[1, 5, 7, 2, 9], [3, 3, 8, 0, 4]])
# Everything but the embeddings and the first two blocks goes to disk.
CPU_AND_DISK = {
    "embed": "cpu",
    "blocks.0": "cpu",
    "blocks.1": "cpu",
    "blocks.2": "disk",
    "blocks.3": "disk",
    "blocks.4": "disk",
    "blocks.5": "disk",
    "head": "disk",
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One model, its outputs, and its weights saved in each layout the loader reads."""
    torch.manual_seed(0)
    model = TinyLM().eval()
    with torch.no_grad():
        expected = model(IDS)
    root = tmp_path_factory.mktemp("checkpoints")
    state = model.state_dict()
    save_file({k: v for k, v in state.items() if k != "head.weight"}, root / "one.safetensors")
    torch.save(state, root / "weights.bin")
    write_model(state, root / "sharded", max_shard_size="10KB", safe_serialization=True)
    write_model(state, root / "sharded-bin", max_shard_size="10KB", safe_serialization=False)
    return {"model": model, "expected": expected, "root": root}


def empty_model() -> TinyLM:
    with bm.init_empty_weights():
        return TinyLM().eval()


@pytest.mark.parametrize(
    "layout",
    [
        "one.safetensors",
        "weights.bin",
        "sharded",
        "sharded/model.safetensors.index.json",
        "sharded-bin",
    ],
)
def test_every_checkpoint_layout_loads_across_cpu_and_disk_with_equal_outputs(
    reference, tmp_path, layout
):
    model = empty_model()
    assert model.embed.weight.device.type == "meta" and model.scale.device.type == "cpu"
    bm.load_checkpoint_and_dispatch(
        model, reference["root"] / layout, device_map=CPU_AND_DISK, offload_folder=tmp_path
    )
    assert model.blocks[0].up.weight.device.type == "cpu"
    assert model.blocks[3].up.weight.device.type == "meta"  # on disk until its forward
    with torch.no_grad():
        for _ in range(3):  # the later ones run with weights fetched ahead, into reused buffers
            assert torch.equal(model(IDS), reference["expected"])
    assert torch.equal(model(IDS), reference["expected"])  # with autograd on, fresh buffers
    assert model.hf_device_map == CPU_AND_DISK
    assert any(t.name.startswith("big-model-prefetch") for t in threading.enumerate())
    bm.remove_hooks(model)


def test_tied_weights_stay_one_tensor_on_cpu_and_are_stored_once_on_disk(reference, tmp_path):
    model = empty_model()
    bm.load_checkpoint_and_dispatch(
        model, reference["root"] / "sharded", device_map=CPU_AND_DISK, offload_folder=tmp_path
    )
    assert model.head.weight is model.embed.weight and model.embed.weight.device.type == "cpu"
    index = json.loads((tmp_path / "offload-index.json").read_text())
    assert "head.weight" not in index and "embed.weight" not in index  # borrowed from the CPU

    on_disk = empty_model()
    tied_to_disk = {"": "cpu", "embed": "disk", "head": "disk"}
    bm.load_checkpoint_and_dispatch(
        on_disk,
        reference["root"] / "sharded",
        device_map=tied_to_disk,
        offload_folder=tmp_path / "both",
    )
    index = json.loads((tmp_path / "both" / "offload-index.json").read_text())
    assert list(index) == ["embed.weight"]  # once, under its first name
    assert on_disk.head.weight is on_disk.embed.weight
    assert torch.equal(on_disk(IDS), reference["expected"])


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_cpu_offload_and_disk_offload_keep_ties_and_outputs(reference, tmp_path, kind):
    torch.manual_seed(0)
    model = TinyLM().eval()
    if kind == "cpu":
        bm.cpu_offload(model, execution_device="cpu")
    else:
        bm.disk_offload(model, tmp_path)
        assert json.loads((tmp_path / "offload-index.json").read_text()).keys() >= {"embed.weight"}
    assert model.head.weight is model.embed.weight and model.embed.weight.device.type == "meta"
    with torch.no_grad():
        assert torch.equal(model(IDS), reference["expected"])
        assert torch.equal(model(IDS), reference["expected"])


class Normed(torch.nn.Module):
    """Two blocks with saved buffers (batch norm's running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
        self.second = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("offload_buffers", [False, True])
def test_buffers_stay_on_the_running_device_unless_offloaded_too(tmp_path, kind, offload_buffers):
    torch.manual_seed(0)
    model = Normed().eval()
    for norm in (model.first[1], model.second[1]):
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2.0)
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
    if kind == "cpu":
        bm.cpu_offload(model, execution_device="cpu", offload_buffers=offload_buffers)
    else:
        bm.disk_offload(model, tmp_path, offload_buffers=offload_buffers)
        index = json.loads((tmp_path / "offload-index.json").read_text())
        assert ("second.1.running_mean" in index) == offload_buffers
    assert model.second[0].weight.device.type == "meta"
    assert model.second[1].running_mean.device.type == ("meta" if offload_buffers else "cpu")
    with torch.no_grad():
        assert torch.equal(model(x), expected)
        assert torch.equal(model(x), expected)


def test_accelerates_arguments_that_cannot_apply_say_why(reference, tmp_path):
    with pytest.raises(TypeError, match=r"offload_index=\.\.\.\) is not supported"):
        bm.dispatch_model(TinyLM(), {"": "cpu"}, offload_index={"a": {}})
    with pytest.raises(TypeError, match=r"skip_keys=3 must be the name of a keyword argument"):
        bm.dispatch_model(TinyLM(), {"": "cpu"}, skip_keys=3)
    model = empty_model()  # those that change nothing here are accepted
    bm.load_checkpoint_and_dispatch(
        model,
        reference["root"] / "sharded",
        device_map=CPU_AND_DISK,
        offload_folder=tmp_path,
        offload_state_dict=True,
        force_hooks=True,
        preload_module_classes=["Block"],
        skip_keys=["cache"],
    )
    assert torch.equal(model(IDS), reference["expected"])


def test_keep_in_fp32_modules_stay_in_float32_in_memory_and_on_disk(reference, tmp_path):
    model = empty_model()
    bm.load_checkpoint_and_dispatch(
        model,
        reference["root"] / "sharded",
        device_map=CPU_AND_DISK,
        offload_folder=tmp_path,
        dtype="bfloat16",
        keep_in_fp32_modules=["blocks.0", "blocks.3"],
    )
    assert model.blocks[0].up.weight.dtype == torch.float32
    assert model.blocks[1].up.weight.dtype == torch.bfloat16
    index = json.loads((tmp_path / "offload-index.json").read_text())
    assert index["blocks.3.up.weight"]["dtype"] == "torch.float32"
    assert index["blocks.4.up.weight"]["dtype"] == "torch.bfloat16"


def test_load_then_dispatch_with_the_same_folder_uses_what_the_load_wrote(reference, tmp_path):
    model = empty_model()
    bm.load_checkpoint_in_model(
        model, reference["root"] / "sharded", CPU_AND_DISK, offload_folder=tmp_path
    )
    written = sorted(p.name for p in tmp_path.iterdir())
    bm.dispatch_model(model, CPU_AND_DISK, offload_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == written  # nothing written again
    with torch.no_grad():
        assert torch.equal(model(IDS), reference["expected"])
    bm.remove_hooks(model)
    other = empty_model()
    bm.load_checkpoint_in_model(
        other, reference["root"] / "sharded", CPU_AND_DISK, offload_folder=tmp_path / "b"
    )
    with pytest.raises(OffloadFolderError, match=r"no offload_folder was given"):
        bm.dispatch_model(other, CPU_AND_DISK)
    with pytest.raises(CheckpointMismatchError, match=r"with the same offload_folder"):
        bm.dispatch_model(other, CPU_AND_DISK, offload_dir=tmp_path / "c")


def test_load_checkpoint_in_model_alone_fills_a_model_built_empty(reference):
    model = empty_model()
    bm.load_checkpoint_in_model(model, reference["root"] / "one.safetensors")
    assert model.head.weight is model.embed.weight
    assert torch.equal(model(IDS), reference["expected"])


def test_budgets_read_bytes_and_both_kinds_of_units():
    assert parse_budget(1234) == 1234
    assert parse_budget("40MB") == 40_000_000
    assert parse_budget("2GiB") == 2 * 2**30
    assert parse_budget("1.5 kib") == 1536
    with pytest.raises(BigModelError, match=r"max_memory\['cpu'\]='lots' is not a size"):
        bm.infer_auto_device_map(empty_model(), max_memory={"cpu": "lots"})


def test_auto_map_fills_devices_in_order_and_keeps_no_split_blocks_whole(monkeypatch):
    monkeypatch.setattr(device_map_module, "cuda_device_count", lambda: 2)
    model = empty_model()
    block = 4 * (32 * 64 * 2 + 64 + 32 + 64)  # one Block's bytes
    plan = bm.infer_auto_device_map(
        model,
        max_memory={0: 2 * block + 7000, 1: 2 * block, "cpu": block},
        no_split_module_classes=["Block"],
    )
    assert plan == {
        "embed": "cuda:0",
        "blocks.0": "cuda:0",
        "blocks.1": "cuda:1",
        "blocks.2": "cuda:1",
        "blocks.3": "cpu",
        "blocks.4": "disk",
        "blocks.5": "disk",
        "head": "disk",
    }
    # Room was kept on cuda:0 for the largest offloaded block: only one block fits beside the embeddings.
    assert plan.sizes["blocks.0"] == block and plan.budgets["cpu"] == block
    balanced = bm.get_balanced_memory(model, {0: "1GB", 1: "1GB", "cpu": "1GB"}, ["Block"])
    assert balanced["cuda:0"] == balanced["cuda:1"] < 10**9
    spread = bm.infer_auto_device_map(model, balanced, ["Block"])
    assert set(spread.values()) == {"cuda:0", "cuda:1"}


def test_the_plan_draws_itself_with_every_name_escaped(capsys):
    model = TinyLM()
    evil = "<img src=x onerror=alert(1)>$x$"
    model.blocks.add_module(evil, torch.nn.Linear(32, 32))
    plan = bm.infer_auto_device_map(model, max_memory={"cpu": "40KB"})
    page = plan._repr_html_()
    assert "<img" not in page and "$" not in page and "tex2jax_ignore" in page
    assert "&lt;img src=x onerror=alert(1)&gt;&#36;x&#36;" in page
    assert page.count("&#9733;") == 3  # the legend, the bar and the list mark the largest block
    assert "of 39.1 KiB" in page and "no limit" in page
    text = plan.describe()
    assert text.splitlines()[1].startswith("cpu ") and evil in text
    bm.show_device_map(plan)  # no kernel here: printed as text
    assert capsys.readouterr().out.strip() == text


def test_the_plan_shows_the_room_left_for_the_kv_cache_and_what_each_forward_moves():
    plan = bm.DeviceMap(
        {"embed": "cuda:0", "blocks.0": "cuda:0", "blocks.1": "cpu", "blocks.2": "disk"},
        sizes={"embed": 1024, "blocks.0": 2048, "blocks.1": 4096, "blocks.2": 8192},
        budgets={"cuda:0": 10 * 1024, "cpu": 8 * 1024},
    )
    lines = plan.describe().splitlines()
    assert "3.0 KiB of 10.0 KiB, 7.0 KiB left for the KV cache" in lines[1]
    assert "4.0 KiB of 8.0 KiB, 4.0 KiB free" in lines[2]  # the cache sits on the GPU
    assert lines[-1] == (
        "Each forward reads 8.0 KiB from disk and copies 4.0 KiB from CPU memory to the GPU."
    )
    page = plan._repr_html_()
    assert "7.0 KiB left for the KV cache" in page and "reads 8.0 KiB from disk" in page
    on_cpu = bm.DeviceMap(
        {"blocks.1": "cpu", "blocks.2": "disk"},
        sizes={"blocks.1": 4096, "blocks.2": 8192},
        budgets={"cpu": 8 * 1024},
    )
    text = on_cpu.describe()
    assert "4.0 KiB left for the KV cache" in text  # no GPU: the CPU runs the layers
    assert text.splitlines()[-1] == "Each forward reads 8.0 KiB from disk."


def test_show_device_map_of_a_dispatched_model_prints_its_plan(reference, tmp_path, capsys):
    model = empty_model()
    bm.load_checkpoint_and_dispatch(
        model,
        reference["root"] / "sharded",
        device_map="auto",
        max_memory={"cpu": "20KB"},
        offload_folder=tmp_path,
        no_split_module_classes=["Block"],
    )
    bm.show_device_map(model)
    out = capsys.readouterr().out
    assert "cpu " in out and "disk" in out and "of 19.5 KiB" in out and "blocks*" in out
    assert torch.equal(model(IDS), reference["expected"])


# Bad input: one clear error, naming the thing ------------------------------------------------


def test_disk_offload_without_a_folder_is_refused(reference):
    with pytest.raises(OffloadFolderError, match="no offload_folder was given"):
        bm.load_checkpoint_and_dispatch(
            empty_model(), reference["root"] / "sharded", device_map=CPU_AND_DISK
        )


def test_an_offload_folder_that_cannot_be_written_is_named(reference, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(
        OffloadFolderError, match=r"offload_folder='.*a-file/sub' cannot be written"
    ):
        bm.load_checkpoint_and_dispatch(
            empty_model(),
            reference["root"] / "sharded",
            device_map=CPU_AND_DISK,
            offload_folder=blocker / "sub",
        )


def test_a_missing_weight_is_never_left_on_meta(reference, tmp_path):
    state = reference["model"].state_dict()
    del state["blocks.3.up.weight"]
    save_file(
        {k: v for k, v in state.items() if k != "head.weight"}, tmp_path / "partial.safetensors"
    )
    with pytest.raises(
        CheckpointMismatchError,
        match=r"has no value for 'blocks.3.up.weight' of TinyLM, which would be left on the meta device",
    ):
        bm.load_checkpoint_and_dispatch(
            empty_model(),
            tmp_path / "partial.safetensors",
            device_map=CPU_AND_DISK,
            offload_folder=tmp_path / "off",
        )
    with pytest.raises(
        CheckpointMismatchError,
        match=r"'embed.weight', .* of TinyLM are on the meta device \(no data\): load the weights first",
    ):
        bm.dispatch_model(empty_model(), {"": "cpu"})


def test_an_unexpected_key_and_a_shape_mismatch_are_named(reference, tmp_path):
    state = {k: v for k, v in reference["model"].state_dict().items() if k != "head.weight"}
    save_file({**state, "extra.weight": torch.zeros(2)}, tmp_path / "extra.safetensors")
    with pytest.raises(
        CheckpointMismatchError, match=r"holds 'extra.weight', which TinyLM does not have"
    ):
        bm.load_checkpoint_in_model(empty_model(), tmp_path / "extra.safetensors")
    with pytest.warns(UserWarning, match="'extra.weight'"):
        bm.load_checkpoint_in_model(empty_model(), tmp_path / "extra.safetensors", strict=False)
    save_file({**state, "blocks.1.up.bias": torch.zeros(3)}, tmp_path / "shape.safetensors")
    with pytest.raises(
        CheckpointMismatchError,
        match=r"'blocks.1.up.bias' has shape \[3\] .* but \[64\] in the model",
    ):
        bm.load_checkpoint_in_model(empty_model(), tmp_path / "shape.safetensors")


def test_a_device_map_naming_a_missing_module_or_leaving_one_out_is_refused(reference):
    with pytest.raises(
        DeviceMapError,
        match=r"names 'block.2', which is neither a module nor a weight of TinyLM\. Did you mean 'blocks.2'",
    ):
        bm.load_checkpoint_in_model(
            empty_model(), reference["root"] / "sharded", device_map={"": "cpu", "block.2": "cpu"}
        )
    partial = {k: v for k, v in CPU_AND_DISK.items() if k != "blocks.4"}
    with pytest.raises(
        DeviceMapError, match=r"leaves out 'blocks.4.norm.weight', 'blocks.4.norm.bias'"
    ):
        bm.load_checkpoint_in_model(
            empty_model(), reference["root"] / "sharded", device_map=partial
        )


def test_a_device_the_machine_lacks_is_named(monkeypatch, reference):
    monkeypatch.setattr(device_map_module, "cuda_device_count", lambda: 2)
    with pytest.raises(
        DeviceMapError,
        match=r"names device 'cuda:3', but this machine has 2 GPUs \(cuda:0 to cuda:1\)",
    ):
        bm.dispatch_model(TinyLM(), {"": "cuda:3"})
    monkeypatch.setattr(device_map_module, "cuda_device_count", lambda: 0)
    with pytest.raises(
        DeviceMapError, match=r"max_memory names device 'cuda:0', but this machine has no GPU"
    ):
        bm.infer_auto_device_map(TinyLM(), max_memory={0: "1GB"})


def test_no_device_with_room_for_the_largest_unsplittable_block(reference):
    with pytest.raises(
        DeviceMapError,
        match=r"No device has room for the largest block that cannot be split, 'blocks.5' \(16.6 KiB\)",
    ):
        bm.load_checkpoint_and_dispatch(
            empty_model(),
            reference["root"] / "sharded",
            device_map="auto",
            max_memory={"cpu": "10KB"},
            no_split_module_classes=["Block"],
        )


def test_memory_estimate_of_a_plain_module_and_its_errors():
    model = TinyLM()
    estimate = bm.estimate_memory(model, batch_size=2, sequence_length=5, example_input=IDS)
    params = sum(p.numel() for p in model.parameters())
    assert estimate.num_parameters == params and estimate.parameters == 4 * params
    assert estimate.optimizer_state == 2 * estimate.gradients == 8 * params
    assert estimate.activations_method == "traced" and estimate.activations > 2 * 5 * 50 * 4
    lora = bm.estimate_memory(
        model,
        dtype="bfloat16",
        lora_rank=4,
        lora_target_modules=["up"],
        world_size=4,
        sharding="fsdp",
        example_input=IDS,
    )
    assert lora.trainable_parameters == 6 * 4 * (64 + 32)
    assert lora.gradients == -(
        -lora.trainable_parameters * 4 // 4
    )  # float32 adapters, split over 4 ranks
    assert "LoRA rank 4" in str(lora) and "4 ranks (fsdp)" in str(lora)
    with pytest.raises(BigModelError, match=r"sharding='zero3'\): pass 'ddp' or 'fsdp'"):
        bm.estimate_memory(model, sharding="zero3")
    with pytest.raises(
        BigModelError, match=r"lora_target_modules=\['q_proj'\]\) matches no module of TinyLM"
    ):
        bm.estimate_memory(model, lora_rank=8, lora_target_modules=["q_proj"])


def test_the_package_imports_nothing_of_the_launcher_or_the_notebook_side():
    forbidden = (
        "notebook_launcher.launcher",
        "notebook_launcher.session",
        "notebook_launcher.widgets",
        "notebook_launcher.server",
        "notebook_launcher.api",
        "ipywidgets",
    )
    for path in (ROOT / "notebook_launcher" / "big_modeling").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            assert not [n for n in names if n.startswith(forbidden)], (path.name, names)


_PEAK_SCRIPT = r"""
import json, sys, torch
from notebook_launcher.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
def rss(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))
class Big(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(24))
    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x
with init_empty_weights():
    model = Big()
before = rss("VmRSS:")
load_checkpoint_and_dispatch(model, sys.argv[1], device_map="auto", max_memory={"cpu": "12MB"},
                             offload_folder=sys.argv[2])
with torch.no_grad():
    out = model(torch.ones(1, 1024))
print(json.dumps({"added": rss("VmHWM:") - before, "sum": out.sum().item(),
                  "devices": sorted(set(model.hf_device_map.values()))}))
"""


def test_peak_memory_stays_within_budget_plus_a_shard_and_blocks(tmp_path):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(24))  # 96 MiB
    state = {f"layers.{k}": v for k, v in layers.state_dict().items()}
    write_model(state, tmp_path / "ckpt", max_shard_size="16MB", safe_serialization=True)
    with torch.no_grad():
        x = torch.ones(1, 1024)
        for layer in layers:
            x = torch.tanh(layer(x))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "ckpt"), str(tmp_path / "off")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["devices"] == ["cpu", "disk"]
    assert abs(result["sum"] - x.sum().item()) < 1e-3
    budget, shard, block = 12e6, 16e6, 4 * 2**20
    # Budget, one shard being read, the block running and the one fetched ahead, plus the
    # allocator's slack; the whole model would add 100 MB.
    assert result["added"] < budget + shard + 2 * block + 16e6, result


def _folder_maps(folder: Path) -> list[tuple[int, int]]:
    """The address ranges of this process mapped from files in ``folder``."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip().startswith(str(folder)):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                found.append((low, high))
    return found


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_disk_blocks_run_on_the_cpu_from_their_file_mapped_ahead_on_the_side_thread(
    reference, tmp_path
):
    from notebook_launcher.big_modeling.hooks import attached

    model = empty_model()
    bm.load_checkpoint_and_dispatch(
        model, reference["root"] / "sharded", device_map=CPU_AND_DISK, offload_folder=tmp_path
    )
    store = attached(model).fetcher.disk
    maps: list[tuple[str, tuple[str, ...]]] = []
    mapped = store.map

    def recording(names):
        maps.append((threading.current_thread().name, tuple(names)))
        return mapped(names)

    store.map = recording
    # While a block on disk computes, its weight lies in a map of the folder's files.
    seen: list[tuple[bool, int]] = []

    class Look(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.linear and args[1].shape == (64, 32):  # an "up"
                address = args[1].data_ptr()
                ranges = _folder_maps(tmp_path)
                seen.append((any(low <= address < high for low, high in ranges), len(ranges)))
            return func(*args, **(kwargs or {}))

    per_forward = []
    with torch.no_grad(), Look():
        for _ in range(3):
            start = len(maps)
            assert torch.equal(model(IDS), reference["expected"])
            per_forward.append(maps[start:])
            # Between forwards nothing of the folder is mapped (its pages may stay cached).
            assert _folder_maps(tmp_path) == []
    # blocks.2 to blocks.5 are on disk, lent a piece at a time (norm, up, down: TinyLM names
    # no block that must stay whole). Each forward maps its first piece ahead as it starts
    # (while the blocks on the CPU compute), and every later one ahead of its turn, on the
    # side thread; nothing is mapped ahead of the next forward.
    for forward in per_forward:
        assert len(forward) == 4 * 3
        assert forward[0][1] == ("blocks.2.norm.weight", "blocks.2.norm.bias")
        assert all(name.startswith("big-model-prefetch") for name, _ in forward)
    # No copy: the block computes from the map. At most the block running and the one
    # mapped ahead are mapped at once.
    assert len(seen) == 3 * 6 and sum(inside for inside, _count in seen) == 3 * 4, seen
    assert max(count for _inside, count in seen) <= 2, seen
    assert attached(model).blocks_in_flight() == (0, 0)


def test_disk_blocks_bound_for_a_gpu_are_read_ahead_into_reused_buffers(reference, tmp_path):
    """The GPU's path (read into pinned buffers, reused), run here without the pinning."""
    from notebook_launcher.big_modeling.hooks import attached

    model = empty_model()
    bm.load_checkpoint_and_dispatch(
        model, reference["root"] / "sharded", device_map=CPU_AND_DISK, offload_folder=tmp_path
    )
    fetcher = attached(model).fetcher
    fetcher.map_disk = False
    store = fetcher.disk
    reads: list[tuple[str, tuple[str, ...]]] = []
    read = store.read

    def recording(names, pin=False, buffer_for=None):
        reads.append((threading.current_thread().name, tuple(names)))
        return read(names, pin=pin, buffer_for=buffer_for)

    store.read = recording
    allocated = []
    make = fetcher._buffer

    def counting(count, pin):
        before = list(fetcher._free)
        buffer = make(count, pin)
        allocated.append(not any(buffer is b for b, _e in before))
        return buffer

    fetcher._buffer = counting
    with torch.no_grad():
        for _ in range(4):
            start = len(reads)
            assert torch.equal(model(IDS), reference["expected"])
            assert len(reads) - start == 4 * 3
    assert all(name.startswith("big-model-prefetch") for name, _ in reads)
    assert attached(model).blocks_in_flight() == (0, 0)
    # Read buffers are reused: the last forwards allocate few. A buffer is reused only once
    # nothing views it, and on a busy machine the side thread may read the next block before
    # the main thread let go of the one it lent: then a fresh buffer is made.
    last = allocated[-2 * 4 * 3 :]
    assert sum(last) <= len(last) // 4, allocated


def test_an_offload_folder_that_cannot_be_mapped_is_read_instead(reference, tmp_path, monkeypatch):
    """Some file systems (FUSE mounts, some network ones) refuse mmap; none is mounted here."""
    from notebook_launcher.big_modeling import disk_store
    from notebook_launcher.big_modeling.hooks import attached

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # what mmap gives on a file system without it

    model = empty_model()
    bm.load_checkpoint_and_dispatch(
        model, reference["root"] / "sharded", device_map=CPU_AND_DISK, offload_folder=tmp_path
    )
    monkeypatch.setattr(disk_store.mmap, "mmap", refuse)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(IDS), reference["expected"])
    assert attached(model).fetcher.map_disk is False
    bm.remove_hooks(model)


@pytest.mark.parametrize("map_disk", [True, False])
def test_an_offload_file_cut_short_after_loading_is_named_with_what_to_do(
    reference, tmp_path, map_disk
):
    from notebook_launcher.big_modeling.hooks import attached

    model = empty_model()
    bm.load_checkpoint_and_dispatch(
        model, reference["root"] / "sharded", device_map=CPU_AND_DISK, offload_folder=tmp_path
    )
    attached(model).fetcher.map_disk = map_disk
    victim = sorted(tmp_path.glob("*blocks.3*.bin"))[0]
    os.truncate(victim, victim.stat().st_size // 2)
    with pytest.raises(
        OffloadFolderError, match=r"blocks\.3.*is shorter than expected.*Load the model again"
    ):
        with torch.no_grad():
            model(IDS)
    assert attached(model).blocks_in_flight() == (0, 0)
    bm.remove_hooks(model)


def test_big_model_names_come_from_the_package_too():
    import notebook_launcher

    assert notebook_launcher.load_checkpoint_and_dispatch is bm.load_checkpoint_and_dispatch
    assert notebook_launcher.estimate_memory is bm.estimate_memory
    assert {"init_empty_weights", "show_device_map", "cpu_offload"} <= set(
        notebook_launcher.__all__
    )


def test_the_command_line_does_not_import_torch_to_register_estimate_memory():
    code = (
        "import sys; from notebook_launcher import cli; cli.build_parser(); "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
    )
    assert done.stdout.strip() == "False", done.stderr
