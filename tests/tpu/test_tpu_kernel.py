"""What a notebook user sees on a (faked) Kaggle TPU v5e-8: launches from a real Jupyter kernel,
with the training function defined in a cell. The fake torch_xla stands in for the chips."""

from __future__ import annotations

import json

import pytest

from tests.support.kernel_driver import RunningKernel
from tests.support.tpu import FAKE_XLA, MACHINES, launch_environ
from tests.test_kernel import assert_no_ranks_left

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def kaggle_kernel():
    running = RunningKernel()
    # What the Kaggle TPU runtime sets before the notebook starts (and torch_xla "installed").
    environ = launch_environ(MACHINES["kaggle-v5e-8"])
    setup = running.run(
        f"""
        import os, sys, time
        os.environ.update(json.loads({json.dumps(json.dumps(environ))}))
        sys.path.insert(0, {FAKE_XLA!r})
        from notebook_launcher import hardware, notebook_launcher
        print(hardware.detect(refresh=True).tpu.describe())
        """.replace("import os, sys, time", "import json, os, sys, time")
    )
    assert setup.error is None, setup.error
    assert "TPU v5litepod-8: 8 chip(s), 8 core(s), 8 process(es)" in setup.stdout
    yield running
    running.shutdown()


def test_a_cell_defined_function_runs_on_every_chip_with_its_output_in_the_cell(kaggle_kernel):
    cell = kaggle_kernel.run(
        """
        def train(scale):
            import torch_xla.runtime as xr
            print("replica", xr.global_ordinal(), "of", xr.world_size(), flush=True)
            return xr.global_ordinal() * scale
        notebook_launcher(train, args=(10,), return_all=True)
        """
    )
    assert cell.error is None, cell.error
    assert cell.result == "[0, 10, 20, 30, 40, 50, 60, 70]"
    for rank in range(8):
        assert f"[rank{rank}]: replica {rank} of 8\n" in cell.stdout
    assert_no_ranks_left(kaggle_kernel.pid)


def test_a_failing_rank_shows_its_traceback_in_the_cell_and_a_rerun_works(kaggle_kernel):
    failing = kaggle_kernel.run(
        """
        def diverge(lr):
            import torch_xla.runtime as xr
            if xr.global_ordinal() == 5:
                raise FloatingPointError(f"lr={lr} diverged on replica 5")
            time.sleep(60)
        notebook_launcher(diverge, args=(3.0,))
        """
    )
    assert (
        failing.error is not None
        and failing.error["ename"] == "RankFailedError[FloatingPointError]"
    )
    assert failing.error["evalue"].startswith("Rank 5 (pid ")
    assert "lr=3.0 diverged on replica 5" in failing.error["evalue"]
    assert "in diverge" in failing.error["evalue"]
    assert_no_ranks_left(kaggle_kernel.pid)
    again = kaggle_kernel.run("notebook_launcher(lambda: 'fine')")
    assert again.error is None and again.result == "'fine'"


def test_a_cell_defined_data_set_that_raises_fails_the_launch_and_objects_come_back(kaggle_kernel):
    failing = kaggle_kernel.run(
        """
        import dataclasses
        import torch
        from torch.utils.data import DataLoader, Dataset
        from notebook_launcher import Accelerator

        class Shards(Dataset):
            def __len__(self):
                return 64
            def __getitem__(self, i):
                if i == 45:
                    raise OSError(f"shard {i} is unreadable")
                return torch.tensor([float(i)])

        def epoch():
            acc = Accelerator()
            seen = sum(1 for _ in acc.prepare(DataLoader(Shards(), batch_size=2)))
            return seen
        notebook_launcher(epoch)
        """
    )
    # Sample 45 is in rank 6's third batch; torch_xla's loader thread alone would have ended
    # that rank's epoch early and the launch would have finished.
    assert failing.error is not None and failing.error["ename"] == "RankFailedError[OSError]"
    assert failing.error["evalue"].startswith("Rank 6 (pid ")
    assert (
        "shard 45 is unreadable" in failing.error["evalue"]
        and "in __getitem__" in failing.error["evalue"]
    )
    assert_no_ranks_left(kaggle_kernel.pid)
    objects = kaggle_kernel.run(
        """
        @dataclasses.dataclass
        class Score:
            rank: int
            f1: float

        def evaluate():
            import numpy as np
            acc = Accelerator()
            return acc.gather_for_metrics([Score(acc.process_index, np.float64(0.5))], use_gather_object=True)
        scores = notebook_launcher(evaluate)
        [type(s).__name__ == "Score" and s.rank for s in scores]
        """
    )
    assert objects.error is None, objects.error
    assert objects.result == "[0, 1, 2, 3, 4, 5, 6, 7]"
    assert_no_ranks_left(kaggle_kernel.pid)


def test_xla_touched_in_a_cell_is_named_before_any_rank_starts(kaggle_kernel):
    # Last in this module: the kernel cannot launch on XLA afterwards until it restarts.
    cell = kaggle_kernel.run(
        """
        import torch, torch_xla
        x = torch.ones(2).to(torch_xla.device())
        notebook_launcher(lambda: 1)
        """
    )
    assert cell.error is not None and cell.error["ename"] == "LaunchConfigError"
    assert "torch_xla's runtime is already running in this kernel" in cell.error["evalue"]
    assert "Restart the kernel" in cell.error["evalue"]
