"""The core on 2 CPU ranks under torchrun, compared with one plain-PyTorch process.

One torchrun run (fixture) executes every check in accelerator_scripts/rank_checks.py;
each test below asserts on what one check produced.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from tests.support.accelerator import SCRIPTS, clean_environment, run_torchrun

sys.path.insert(0, str(SCRIPTS))
import common

TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ranks")
    # The precision a launcher would choose: Accelerator() must pick it up, explicit arguments win.
    run_torchrun(
        SCRIPTS / "rank_checks.py",
        str(out),
        env=clean_environment(ACCELERATE_MIXED_PRECISION="bf16"),
    )
    load = lambda r: torch.load(out / f"results_rank{r}.pt", weights_only=False)  # noqa: E731
    return {"out": out, "rank0": load(0), "rank1": load(1)}


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, **TOLERANCE, msg=f"parameter {name} differs")


def test_each_rank_sees_its_rank_world_size_and_launcher_precision(ranks: dict[str, Any]) -> None:
    for r in (0, 1):
        identity = ranks[f"rank{r}"]["identity"]
        assert identity["process_index"] == r
        assert identity["local_process_index"] == r
        assert identity["num_processes"] == 2
        assert identity["is_main_process"] == (r == 0)
        assert identity["device"] == "cpu"
        assert identity["distributed_type"] == "MULTI_CPU"
        assert identity["env_precision"] == "bf16"


@pytest.mark.parametrize("run", ["ddp", "fsdp"])
def test_two_ranks_with_batch_b_reach_the_weights_of_one_process_with_batch_2b(
    ranks: dict[str, Any], run: str
) -> None:
    reference = common.train_reference(batch_size=8, scheduler_steps=2)
    got = ranks["rank0"][run]
    assert_same_weights(got["state_dict"], reference["state_dict"])
    # Clipping saw the same global gradient norm at every step; the schedule advanced alike.
    assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5, abs=1e-6)
    assert got["lr"] == pytest.approx(reference["lr"])
    if run == "ddp":
        # Both ranks end with the same weights.
        assert_same_weights(ranks["rank1"][run]["state_dict"], got["state_dict"])
    else:
        # FSDP2 gathers the full weights on rank 0 only (to its CPU memory).
        assert ranks["rank1"][run]["state_dict"] == {}


def test_fsdp_really_shards_the_parameters(ranks: dict[str, Any]) -> None:
    assert ranks["rank0"]["fsdp"]["parameter_type"] == "DTensor"
    assert ranks["rank0"]["ddp"]["parameter_type"] == "Parameter"


def test_accumulating_two_steps_on_two_ranks_matches_one_process_with_batch_4b(
    ranks: dict[str, Any],
) -> None:
    reference = common.train_reference(batch_size=16, scheduler_steps=2)
    got = ranks["rank0"]["ddp_accum"]
    assert_same_weights(got["state_dict"], reference["state_dict"])
    assert len(got["norms"]) == len(reference["norms"])  # optimizer stepped once per 2 batches
    assert got["lr"] == pytest.approx(reference["lr"])


@pytest.mark.parametrize("run", ["ddp", "fsdp"])
def test_checkpoint_saved_on_rank0_reloads_in_one_process_with_the_same_outputs(
    ranks: dict[str, Any], run: str
) -> None:
    model = common.make_model()
    model.load_state_dict(torch.load(ranks["out"] / f"{run}.pt", weights_only=True))
    with torch.no_grad():
        outputs = model(common.probe())
    torch.testing.assert_close(outputs, ranks["rank0"][run]["probe_output"], **TOLERANCE)


@pytest.mark.parametrize("case", ["metrics_batches", "metrics_split", "metrics_iterable"])
def test_gather_for_metrics_returns_one_prediction_per_sample_in_order(
    ranks: dict[str, Any], case: str
) -> None:
    # 10 samples on 2 ranks: the last step is padded with repeats, which must be dropped.
    predictions, objects = ranks["rank0"][case]
    assert predictions == [float(i) for i in range(10)]
    assert objects == list(range(10))
    assert ranks["rank1"][case] == ranks["rank0"][case]


def test_shuffled_shards_cover_every_sample_once_per_epoch(ranks: dict[str, Any]) -> None:
    shard0, shard1 = ranks["rank0"]["shuffled_shard"], ranks["rank1"]["shuffled_shard"]
    assert sorted(shard0 + shard1) == list(range(16))
    for epoch in (0, 1):
        both = ranks["rank0"]["seedable"][epoch] + ranks["rank1"]["seedable"][epoch]
        assert sorted(both) == list(range(16))
    # The seedable sampler reshuffles each epoch.
    assert ranks["rank0"]["seedable"][0] != ranks["rank0"]["seedable"][1]


def test_collectives_combine_the_ranks_values(ranks: dict[str, Any]) -> None:
    c0, c1 = ranks["rank0"]["collectives"], ranks["rank1"]["collectives"]
    assert c0["gather"] == [0, 0, 1, 10]
    assert c0["gather_scalar"] == [0.5, 1.5]
    assert c0["gather_nested"] == {"a": [0, 1]}
    assert c0["reduce_sum"] == [3.0] and c1["reduce_sum"] == [3.0]
    assert c0["reduce_mean"] == [1.5]
    assert c0["padded_shape"] == [2, 2] == c1["padded_shape"]
    assert c0["gathered_padded"] == [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0], [2.0, 2.0]]


def test_print_and_on_main_process_run_on_rank0_only(ranks: dict[str, Any]) -> None:
    c0, c1 = ranks["rank0"]["collectives"], ranks["rank1"]["collectives"]
    assert (c0["printed"], c1["printed"]) == ("only once\n", "")
    assert (c0["on_main"], c1["on_main"]) == ("ran", None)


def test_main_process_first_lets_rank0_finish_before_the_others_start(
    ranks: dict[str, Any],
) -> None:
    assert ranks["rank0"]["collectives"]["order"] == ["0", "1"]


def test_split_between_processes_gives_each_rank_a_contiguous_share(ranks: dict[str, Any]) -> None:
    c0, c1 = ranks["rank0"]["collectives"], ranks["rank1"]["collectives"]
    assert (c0["share"], c1["share"]) == ([0, 1, 2], [3, 4])
    assert (c0["padded_share"], c1["padded_share"]) == ([0, 1, 2], [3, 4, 4])
    assert (c0["dict_share"], c1["dict_share"]) == ({"a": [1], "b": ["x"]}, {"a": [2], "b": ["y"]})


def test_bf16_autocast_is_active_in_a_prepared_ddp_model_and_the_autocast_block(
    ranks: dict[str, Any],
) -> None:
    bf16 = ranks["rank1"]["bf16"]
    assert bf16["type"] == "DistributedDataParallel"
    assert bf16["inner_linear"] == "torch.bfloat16"
    assert bf16["output"] == "torch.float32"  # outputs come back in fp32 for the loss
    assert bf16["autocast_block"] == "torch.bfloat16"


def test_hugging_face_accelerate_in_a_rank_sees_the_same_world_and_precision(
    ranks: dict[str, Any],
) -> None:
    for r in (0, 1):
        hf = ranks[f"rank{r}"]["hf_accelerate"]
        ours = ranks[f"rank{r}"]["identity"]
        assert hf["num_processes"] == ours["num_processes"] == 2
        assert hf["process_index"] == ours["process_index"] == r
        assert hf["mixed_precision"] == ours["env_precision"] == "bf16"
        assert (
            torch.device(hf["device"]).type == torch.device(ours["device"]).type
        )  # accelerate says "cpu:0"


def test_end_training_leaves_the_process_group_it_created(ranks: dict[str, Any]) -> None:
    assert ranks["rank0"]["group_destroyed"] and ranks["rank1"]["group_destroyed"]
