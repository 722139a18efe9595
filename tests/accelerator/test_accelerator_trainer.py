"""transformers' Trainer inside notebook_launcher on 2 CPU ranks ends bit-identical to torchrun.

A tiny BERT built from a config (no download), gradient accumulation, clipping and a linear
schedule; the same script runs under ``torchrun --nproc-per-node 2``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from notebook_launcher import notebook_launcher
from tests.support.accelerator import SCRIPTS, plain_process, run_torchrun  # noqa: F401

sys.path.insert(0, str(SCRIPTS))
pytest.importorskip("transformers")
import trainer_tiny

pytestmark = pytest.mark.usefixtures("plain_process")


@pytest.mark.slow(reason="trains in launched ranks and under torchrun, side by side")
def test_trainer_in_launched_cpu_ranks_matches_torchrun_bit_for_bit(tmp_path: Path) -> None:
    ours = notebook_launcher(
        trainer_tiny.train,
        args=(str(tmp_path / "ours"),),
        num_processes=2,
        hardware="cpu",
        output="none",
        return_all=True,
    )
    (tmp_path / "torchrun").mkdir()
    run_torchrun(SCRIPTS / "trainer_tiny.py", str(tmp_path / "torchrun"))
    reference = [torch.load(tmp_path / "torchrun" / f"trainer_rank{r}.pt") for r in (0, 1)]
    for rank in (0, 1):
        got, expected = ours[rank], reference[rank]
        # Trainer saw both ranks (a world of one would train on all the data alone).
        assert (got["world_size"], got["process_index"]) == (2, rank)
        assert got["global_step"] == expected["global_step"] == 3
        assert got["losses"] == expected["losses"]
        assert got["state_dict"].keys() == expected["state_dict"].keys()
        for name, value in expected["state_dict"].items():
            assert torch.equal(got["state_dict"][name], value), f"{name} differs from torchrun's"
    # Both ranks end with the same weights.
    for name, value in ours[0]["state_dict"].items():
        assert torch.equal(ours[1]["state_dict"][name], value)
