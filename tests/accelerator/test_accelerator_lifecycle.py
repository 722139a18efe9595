"""accelerate's calls around the loop: save_model, free_memory, join_uneven_inputs, state hooks,
even_batches, stateful loaders, profile, copy_tensor_to_devices, PartialState.

Most run on 2 real CPU ranks started by notebook_launcher; what they wrote is read back here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from notebook_launcher import notebook_launcher
from tests.support.accelerator import plain_process  # noqa: F401

pytestmark = pytest.mark.usefixtures("plain_process")


def on_two_ranks(function: Any, *args: Any) -> Any:
    return notebook_launcher(
        function, args=args, num_processes=2, hardware="cpu", output="none", return_all=True
    )


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models do


def save_models(folder: str) -> dict[str, Any]:
    from notebook_launcher.accelerator import Accelerator

    torch.manual_seed(0)
    acc = Accelerator()
    model = acc.prepare(Tied())
    acc.save_model(model, Path(folder) / "one")
    acc.save_model(model, Path(folder) / "sharded", max_shard_size=400)
    acc.save_model(model, Path(folder) / "bin", safe_serialization=False)
    acc.wait_for_everyone()
    return {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}


def test_save_model_writes_safetensors_split_by_size_with_an_index(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    weights = on_two_ranks(save_models, str(tmp_path))[0]
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["model.safetensors"]
    single = load_file(tmp_path / "one" / "model.safetensors")
    # The tied weight is stored once, under its first name.
    assert "head.weight" not in single
    for name, value in single.items():
        torch.testing.assert_close(value, weights[name])

    files = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and files[-1] == "model.safetensors.index.json"
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        merged.update(load_file(tmp_path / "sharded" / shard))
    assert set(index["weight_map"]) == set(merged) == set(single)
    assert all(
        merged[k].numel() * merged[k].element_size() <= 400
        or len(load_file(tmp_path / "sharded" / index["weight_map"][k])) == 1
        for k in merged
    )
    bin_state = torch.load(tmp_path / "bin" / "pytorch_model.bin")
    assert set(bin_state) == set(single)


def test_save_model_refuses_a_size_it_cannot_read(tmp_path: Path) -> None:
    from notebook_launcher.accelerator import Accelerator, AcceleratorError

    acc = Accelerator()
    with pytest.raises(
        AcceleratorError, match=r"max_shard_size='ten' is not a size; pass a number of bytes"
    ):
        acc.save_model(torch.nn.Linear(2, 2), tmp_path, max_shard_size="ten")
    (tmp_path / "file").write_text("")
    with pytest.raises(Exception, match=r"that is a file; pass a folder"):
        acc.save_model(torch.nn.Linear(2, 2), tmp_path / "file")


def test_free_memory_forgets_prepared_objects_and_returns_nones() -> None:
    from torch.utils.data import DataLoader

    from notebook_launcher.accelerator import Accelerator

    acc = Accelerator()
    model = torch.nn.Linear(2, 2)
    model, opt, loader = acc.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(list(range(4)), batch_size=2)
    )
    assert acc._models and acc._optimizers and acc._dataloaders
    model, opt, loader = acc.free_memory(model, opt, loader)
    assert (model, opt, loader) == (None, None, None)
    assert not (acc._models or acc._optimizers or acc._dataloaders or acc._schedulers)
    assert acc.clear() == []


def join_uneven() -> dict[str, Any]:
    from notebook_launcher.accelerator import Accelerator, DataLoaderConfiguration

    acc = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    model = acc.prepare(torch.nn.Linear(1, 1))
    loader = acc.prepare(torch.utils.data.DataLoader(torch.arange(3.0)[:, None], batch_size=1))
    steps = []
    with acc.join_uneven_inputs([model]):
        for i, batch in enumerate(loader):
            model(batch).sum().backward()
            steps.append(i)
    acc.wait_for_everyone()
    even = Accelerator()
    model2 = even.prepare(torch.nn.Linear(1, 1))
    loader2 = even.prepare(torch.utils.data.DataLoader(torch.arange(3.0)[:, None], batch_size=1))
    with even.join_uneven_inputs([model2], even_batches=False):
        inside = loader2.batch_sampler.even_batches
    return {"steps": steps, "inside": inside, "after": loader2.batch_sampler.even_batches}


def test_join_uneven_inputs_lets_ranks_with_fewer_batches_finish_on_cpu_ranks() -> None:
    results = on_two_ranks(join_uneven)
    assert results[0]["steps"] == [0, 1]
    assert results[1]["steps"] == [0]
    for got in results:
        assert got["inside"] is False and got["after"] is True


def test_join_uneven_inputs_on_one_process_does_nothing() -> None:
    from notebook_launcher.accelerator import Accelerator

    acc = Accelerator()
    with acc.join_uneven_inputs([torch.nn.Linear(1, 1)]):
        pass


def test_even_batches_reads_and_writes_the_loader_configuration() -> None:
    from notebook_launcher.accelerator import Accelerator

    acc = Accelerator()
    assert acc.even_batches is True
    acc.even_batches = False
    assert acc.dataloader_config.even_batches is False


def test_state_hooks_see_models_and_weights_and_can_take_a_model_out(tmp_path: Path) -> None:
    from notebook_launcher.accelerator import Accelerator

    acc = Accelerator()
    first, second = acc.prepare(torch.nn.Linear(2, 2), torch.nn.Linear(3, 3))
    seen: list[Any] = []

    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        seen.append(("save", len(models), [sorted(w) for w in weights], output_dir))
        weights.pop()  # the second model is saved elsewhere

    def load_hook(models: list[Any], input_dir: str) -> None:
        seen.append(("load", len(models), input_dir))
        models.pop()

    save_handle = acc.register_save_state_pre_hook(save_hook)
    load_handle = acc.register_load_state_pre_hook(load_hook)
    acc.save_state(tmp_path / "ckpt")
    assert seen[0] == ("save", 2, [["bias", "weight"], ["bias", "weight"]], str(tmp_path / "ckpt"))
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("model*")) == ["model.safetensors"]
    before = second.weight.detach().clone()
    with torch.no_grad():
        first.weight.zero_()
        second.weight.zero_()
    acc.load_state(tmp_path / "ckpt")
    assert seen[1] == ("load", 2, str(tmp_path / "ckpt"))
    assert first.weight.abs().sum() > 0  # restored
    assert second.weight.abs().sum() == 0 and before.abs().sum() > 0  # left to the hook
    save_handle.remove()
    load_handle.remove()
    acc.save_state(tmp_path / "again")
    assert len(seen) == 2


def batch_sampler_as_sampler() -> list[int]:
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, default_collate

    from notebook_launcher.accelerator import Accelerator

    class Rows(torch.utils.data.Dataset):  # fetches a whole batch of indices at once
        def __len__(self) -> int:
            return 10

        def __getitem__(self, index: Any) -> Any:
            return [torch.tensor(i) for i in index]

    acc = Accelerator()
    data = Rows()
    loader = acc.prepare(
        DataLoader(
            data,
            sampler=BatchSampler(SequentialSampler(data), batch_size=2, drop_last=False),
            batch_size=None,
            collate_fn=default_collate,
        )
    )
    seen = []
    for batch in loader:
        seen.extend(int(x) for x in acc.gather_for_metrics(batch))
    return [int(x) for batch in loader for x in batch] + [-1] + seen


def test_a_batch_sampler_given_as_sampler_is_sharded_across_ranks() -> None:
    results = on_two_ranks(batch_sampler_as_sampler)
    rank0, rank1 = (r[: r.index(-1)] for r in results)
    assert rank0 == [0, 1, 4, 5, 8, 9]
    assert rank1 == [2, 3, 6, 7, 0, 1]  # even_batches: the last step repeats the first samples
    # gather_for_metrics drops those repeats: every sample once, in order.
    assert results[0][results[0].index(-1) + 1 :] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]


def stateful_resume(folder: str) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    from notebook_launcher.accelerator import Accelerator, DataLoaderConfiguration

    torch.manual_seed(0)
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    loader = acc.prepare(DataLoader(torch.arange(40), batch_size=2, shuffle=True))
    rest, state = [], None
    for step, batch in enumerate(loader):
        if step == 2:
            state = loader.state_dict()
            acc.save_state(folder)
        if step > 2:
            rest.append(batch.tolist())
    loader.load_state_dict(state)
    resumed = [b.tolist() for b in loader]
    acc.load_state(folder)
    resumed_from_folder = [b.tolist() for b in loader]
    return {
        "rest": rest,
        "resumed": resumed,
        "from_folder": resumed_from_folder,
        "next": len(list(loader)),
    }


def test_a_stateful_loader_continues_its_epoch_after_load_state_dict_and_load_state(
    tmp_path: Path,
) -> None:
    for got in on_two_ranks(stateful_resume, str(tmp_path / "ckpt")):
        assert len(got["rest"]) == 10 - 3
        assert got["resumed"] == got["rest"]
        assert got["from_folder"] == got["rest"]
        assert got["next"] == 10  # the pass after a resumed one is whole again


def profile_and_copy(folder: str) -> dict[str, Any]:
    from notebook_launcher.accelerator import (
        Accelerator,
        PartialState,
        ProfileKwargs,
        copy_tensor_to_devices,
    )

    acc = Accelerator(kwargs_handlers=[ProfileKwargs(output_trace_dir=folder, record_shapes=True)])
    with acc.profile() as prof:
        torch.nn.functional.linear(torch.randn(4, 4), torch.randn(4, 4))
    names = {e.key for e in prof.key_averages()}
    state = PartialState()
    copied = copy_tensor_to_devices(
        torch.tensor([1, 2, 3], dtype=torch.int32) if state.is_main_process else None
    )
    return {
        "linear": any("linear" in n for n in names),
        "copied": (copied.tolist(), str(copied.dtype)),
        "state": (state.num_processes, state.process_index, state.distributed_type.value),
    }


def test_profile_writes_a_trace_per_rank_and_copy_tensor_to_devices_sends_rank0s_tensor(
    tmp_path: Path,
) -> None:
    results = on_two_ranks(profile_and_copy, str(tmp_path / "traces"))
    for rank, got in enumerate(results):
        assert got["linear"]
        assert got["copied"] == ([1, 2, 3], "torch.int32")
        assert got["state"] == (2, rank, "MULTI_CPU")
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "trace_rank0.json",
        "trace_rank1.json",
    ]
    assert "traceEvents" in json.loads((tmp_path / "traces" / "trace_rank0.json").read_text())


def test_partial_state_is_exported_from_the_package_top() -> None:
    import notebook_launcher

    state = notebook_launcher.PartialState()
    assert (state.num_processes, state.process_index, state.distributed_type.value) == (1, 0, "NO")
