"""``estimate_memory`` against what each rank measured, for full fine-tuning, LoRA, DDP and FSDP2.

The estimate lives in ``notebook_launcher.big_modeling``; this module runs once that is
there. One launch trains each setup on 2 CPU ranks and returns ``memory_summary()``:
the bytes of parameters, gradients and AdamW state each rank holds, and its peak RSS.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from notebook_launcher import notebook_launcher
from tests.support.accelerator import SCRIPTS

big_modeling = pytest.importorskip("notebook_launcher.big_modeling")
pytest.importorskip("peft")
sys.path.insert(0, str(SCRIPTS))
import lora_tiny  # noqa: E402

SETUPS = {"full-ddp": (None, "ddp"), "lora-ddp": (4, "ddp"), "full-fsdp": (None, "fsdp")}
LAYERS, HIDDEN = 4, 256


def measure() -> dict[str, dict[str, Any]]:
    import torch
    from peft import get_peft_model

    from notebook_launcher import Accelerator, rank_memory
    from notebook_launcher.accelerator.kwargs import FullyShardedDataParallelPlugin

    measured: dict[str, dict[str, Any]] = {}
    for name, (lora_rank, sharding) in SETUPS.items():
        plugin = FullyShardedDataParallelPlugin() if sharding == "fsdp" else None
        accelerator = Accelerator(fsdp_plugin=plugin)
        start = rank_memory.read().current_bytes
        model = lora_tiny.base_model(seed=0, layers=LAYERS, hidden=HIDDEN)
        if lora_rank:
            model = get_peft_model(model, lora_tiny.lora_config())
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        rank_memory.reset_peak()
        ids = lora_tiny.Tokens().ids[:2]
        for _ in range(2):
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
        summary = accelerator.memory_summary()
        measured[name] = {**summary, "growth": summary["peak_bytes"] - start}
        del model, optimizer
    return measured


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[str, Any]]:
    return notebook_launcher(measure, num_processes=2, hardware="cpu", output="none")


def _estimate(lora_rank: int | None, sharding: str) -> Any:
    return big_modeling.estimate_memory(
        lora_tiny.llama_config(layers=LAYERS, hidden=HIDDEN), dtype="float32", batch_size=2,
        sequence_length=lora_tiny.LENGTH, lora_rank=lora_rank,
        lora_target_modules=["q_proj", "v_proj"] if lora_rank else None, world_size=2,
        sharding=sharding,
    )  # fmt: skip


@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_estimate_per_rank_matches_what_the_rank_holds(measured, setup):
    estimate = _estimate(*SETUPS[setup])
    got = measured[setup]
    assert estimate.parameters == pytest.approx(got["parameters_bytes"], rel=0.02)
    assert estimate.gradients == pytest.approx(got["gradients_bytes"], rel=0.02)
    assert estimate.optimizer_state == pytest.approx(got["optimizer_state_bytes"], rel=0.02)


def test_the_estimate_orders_the_setups_as_measured(measured):
    totals = {name: _estimate(*setup).total for name, setup in SETUPS.items()}
    held = {
        name: sum(
            measured[name][k]
            for k in ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes")
        )
        for name in SETUPS
    }
    assert sorted(totals, key=totals.__getitem__) == sorted(held, key=held.__getitem__)
    # Full fine-tuning's whole estimate against the rank's measured growth while training.
    full = _estimate(*SETUPS["full-ddp"]).total
    assert 0.5 * full < measured["full-ddp"]["growth"] < 2.5 * full
