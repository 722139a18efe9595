"""Fine-tuning in a launch: LoRA through our Accelerator, TRL's SFTTrainer and Trainer with peft.

One launch of notebook_launcher on 2 CPU ranks and one ``torchrun --nproc-per-node 2`` of
the same script (with accelerate's own Accelerator for the LoRA loop) are compared fact by
fact: world size, sharded data, falling loss, and weights bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from notebook_launcher import launches, notebook_launcher
from tests.support.accelerator import (
    SCRIPTS,
    clean_environment,
    lost_its_port,
    run_torchrun,
    torchrun_command,
)

pytest.importorskip("peft")
pytest.importorskip("trl")
sys.path.insert(0, str(SCRIPTS))
# Imported here, before the ranks fork, so that each rank finds them loaded.
import datasets  # noqa: F401
import finetune_pair
import peft  # noqa: F401
import transformers  # noqa: F401
import trl  # noqa: F401

# One launch and one torchrun for every test here, together over 30 s on a busy machine
# (each imports transformers, peft, trl and datasets): the module's fixture shares them.
pytestmark = pytest.mark.slow(
    reason="trains LoRA under torchrun and under the launcher, to compare: about 1 min"
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ours_dir = tmp_path_factory.mktemp("ours")
    torchrun_dir = tmp_path_factory.mktemp("torchrun")
    # torchrun runs while the launch runs: both spend most of their time importing.
    with subprocess.Popen(
        torchrun_command(SCRIPTS / "finetune_pair.py", str(torchrun_dir)),
        env=clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as torchrun:
        try:
            ours = notebook_launcher(
                finetune_pair.train, args=(str(ours_dir),), num_processes=2, hardware="cpu",
                output="none", return_all=True,
            )  # fmt: skip
            record = launches()[-1]
            output, _ = torchrun.communicate(timeout=900)  # a safety net
        finally:
            if torchrun.poll() is None:
                torchrun.kill()
    if torchrun.returncode != 0 and lost_its_port(output):  # again, alone, on a fresh port
        run_torchrun(SCRIPTS / "finetune_pair.py", str(torchrun_dir))
    else:
        assert torchrun.returncode == 0, output[-8000:]
    reference = [torch.load(torchrun_dir / f"pair_rank{r}.pt", weights_only=False) for r in (0, 1)]
    return {"ours": ours, "torchrun": reference, "record": record}


def _equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys() and got
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{name} differs from torchrun's"


def test_lora_trains_only_the_adapter_synced_and_equal_to_accelerate_under_torchrun(runs):
    ours = [r["lora"] for r in runs["ours"]]
    reference = [r["lora"] for r in runs["torchrun"]]
    for rank in (0, 1):
        got, expected = ours[rank], reference[rank]
        assert (got["world_size"], got["process_index"]) == (2, rank)
        assert got["trainable"] and all("lora_" in name for name in got["trainable"])
        assert got["base_unchanged"]  # the frozen base, and no unused-parameter error from it
        assert got["seen"] == expected["seen"]
        assert got["losses"] == expected["losses"]
        _equal(got["adapter"], expected["adapter"])  # bit-identical, not merely close
        assert got["first_grads"].keys() == set(got["trainable"])
    # Each rank saw its own half of the samples, and the adapter's gradients were averaged.
    assert sorted(set(ours[0]["seen"]) | set(ours[1]["seen"])) == list(range(16))
    assert not set(ours[0]["seen"]) & set(ours[1]["seen"])
    _equal(ours[0]["first_grads"], ours[1]["first_grads"])
    _equal(ours[0]["adapter"], ours[1]["adapter"])


def test_the_saved_adapter_holds_the_adapter_alone_and_loads_back_and_merges(runs):
    got = runs["ours"][0]["lora"]
    for folder in ("save_model", "save_pretrained"):
        assert got["files"][folder] == [
            "README.md",
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
    assert len(got["saved_keys"]) == len(got["trainable"])
    assert all("lora_A" in k or "lora_B" in k for k in got["saved_keys"])
    assert got["training_changed_logits"] > 1e-3  # the adapter learned something to save
    assert got["loaded_logits_diff"] == 0.0
    assert got["merged_is_plain"] == "LlamaForCausalLM" and got["merged_logits_diff"] < 1e-5


def test_each_rank_reports_its_peak_memory_to_the_record_and_in_memory_summary(runs):
    for rank in (0, 1):
        summary = runs["ours"][rank]["lora"].get("memory") or {}
        shown = runs["record"]["ranks"][rank]["peak_memory"]
        assert shown["kind"] == "rss" and shown["device"] == "cpu"
        assert shown["peak_bytes"] >= shown["current_bytes"] > 50_000_000  # torch alone is more
        if rank == 0:
            assert summary["kind"] == "rss" and summary["process_index"] == 0
            assert 0 < summary["peak_bytes"] <= shown["peak_bytes"]  # read earlier in the same rank
            assert 0 < summary["trainable_parameters_bytes"] < summary["parameters_bytes"] / 10
            assert summary["optimizer_state_bytes"] >= 2 * summary["trainable_parameters_bytes"]


def test_sft_trainer_and_trainer_with_peft_in_a_launch_match_torchrun_bit_for_bit(runs):
    for rank in (0, 1):
        got, expected = runs["ours"][rank], runs["torchrun"][rank]
        sft, sft_expected = got["sft"], expected["sft"]
        assert (sft["world_size"], sft["process_index"]) == (2, rank)
        assert sft["global_step"] == sft_expected["global_step"] == 6
        assert sft["samples_seen"] == sft_expected["samples_seen"]
        assert sft["losses"] == sft_expected["losses"] and sft["losses"][-1] < sft["losses"][0]
        assert all("lora_" in name for name in sft["trainable"])
        _equal(sft["adapter"], sft_expected["adapter"])
        trainer, trainer_expected = got["trainer"], expected["trainer"]
        assert trainer["world_size"] == 2 and trainer["global_step"] == 4
        assert trainer["losses"] == trainer_expected["losses"]
        assert trainer["losses"][-1] < trainer["losses"][0]
        _equal(trainer["adapter"], trainer_expected["adapter"])
    seen = [runs["ours"][r]["sft"]["samples_seen"] for r in (0, 1)]
    assert sorted(seen[0] + seen[1]) == list(range(32))  # each sample on exactly one rank
