"""The core inside ranks started by notebook_launcher (the way notebooks use it)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from notebook_launcher import notebook_launcher
from tests.support.accelerator import SCRIPTS, plain_process  # noqa: F401

sys.path.insert(0, str(SCRIPTS))
import common

pytestmark = pytest.mark.usefixtures("plain_process")


def identities_and_training() -> dict[str, Any]:
    from accelerate import Accelerator as HFAccelerator

    from notebook_launcher.accelerator import Accelerator

    ours = Accelerator()
    seen: list[torch.dtype] = []
    model = ours.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    ours.unwrap_model(model)[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model(torch.randn(2, 4))
    hf = HFAccelerator()
    trained = common.train_with_accelerator(Accelerator(mixed_precision="no"), batch_size=4)
    return {
        "ours": (ours.num_processes, ours.process_index, ours.mixed_precision, str(ours.device)),
        "hf": (
            hf.num_processes,
            hf.process_index,
            hf.mixed_precision,
            torch.device(hf.device).type,
        ),
        "linear_dtype": seen,
        "state_dict": trained["state_dict"],
    }


def test_in_launched_ranks_ours_and_accelerates_accelerator_agree_and_training_matches_one_process() -> (
    None
):
    results = notebook_launcher(
        identities_and_training, num_processes=2, mixed_precision="bf16", return_all=True
    )
    for rank, result in enumerate(results):
        assert result["ours"] == (2, rank, "bf16", "cpu")
        assert result["hf"] == (2, rank, "bf16", "cpu")
        assert result["linear_dtype"] == [torch.bfloat16]  # the launcher's bf16 really runs
    reference = common.train_reference(batch_size=8, scheduler_steps=2)
    for name, value in reference["state_dict"].items():
        torch.testing.assert_close(results[0]["state_dict"][name], value, atol=1e-6, rtol=1e-5)


def fp16_on_cpu() -> str:
    from notebook_launcher.accelerator import Accelerator

    accelerator = Accelerator(mixed_precision="fp16")
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    return str(model(torch.randn(2, 4)).dtype) + " " + accelerator.mixed_precision


def test_fp16_asked_for_in_a_cpu_rank_runs() -> None:
    # torch runs float16 autocast and gradient scaling on CPU; the core does not refuse it.
    assert notebook_launcher(fp16_on_cpu, num_processes=2, return_all=True) == [
        "torch.float32 fp16",
        "torch.float32 fp16",
    ]


def fp8_on_cpu() -> None:
    from notebook_launcher.accelerator import Accelerator

    Accelerator(mixed_precision="fp8")


def test_a_precision_a_cpu_rank_cannot_run_fails_the_launch_with_the_reason() -> None:
    with pytest.raises(
        ValueError,
        match=r"asks for 'fp8', which cannot run here: fp8 needs a Hopper-class NVIDIA GPU",
    ):
        notebook_launcher(fp8_on_cpu, num_processes=2)
