"""The real torch_xla on the CPU (PJRT_DEVICE=CPU): opt-in, run by `make test-xla`.

torch_xla needs its own torch version (a multi-GB install), so it lives in `.venv-xla`;
in the default environment these tests are skipped. On the CPU torch_xla runs one replica
(its collectives across CPU device threads are unsupported upstream), so cases that need
several replicas run on the fake torch_xla only (tests/tpu/test_tpu_xla_core.py, with the same
functions from tests/support/tpu_scripts/xla_cases.py where one replica can show the case).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# The script launches 7 times, each starting torch_xla afresh: minutes on a busy machine.
pytestmark = [pytest.mark.xla, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).parents[1] / "support" / "tpu_scripts" / "real_xla_launch.py"
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def launched() -> subprocess.CompletedProcess[str]:
    torch_xla = pytest.importorskip(
        "torch_xla", reason="the real torch_xla runs in .venv-xla: make test-xla"
    )
    if str(getattr(torch_xla, "__version__", "")).endswith("+fake"):
        pytest.skip("the fake torch_xla is on the path")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)}
    env.pop("NOTEBOOK_LAUNCHER_LAUNCH_ID", None)
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=840
    )
    print(result.stdout)
    print(result.stderr[-4000:], file=sys.stderr)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _line(result: subprocess.CompletedProcess[str], prefix: str) -> str:
    return next(line for line in result.stdout.splitlines() if line.startswith(prefix))


def test_one_xla_rank_trains_with_the_core_and_returns_its_value(launched):
    import json

    value = json.loads(_line(launched, "value:").removeprefix("value:"))
    assert value["device_type"] == "xla" and value["distributed_type"] == "XLA"
    assert value["last_loss"] < value["first_loss"] / 4  # the optimizer stepped the XLA weights
    assert value["gathered"] == [1.0, 2.0]
    assert _line(launched, "[rank0]: trained on xla:0")


def test_bf16_runs_on_xla(launched):
    import json

    value = json.loads(_line(launched, "bf16 value:").removeprefix("bf16 value:"))
    assert value["mixed_precision"] == "bf16" and value["last_loss"] < value["first_loss"]


def test_an_error_raised_in_the_xla_rank_comes_back_with_its_type_and_traceback(launched):
    assert (
        _line(launched, "error type:") == "error type: RankFailedError[KeyError] is KeyError: True"
    )
    assert "raised KeyError: 'the XLA rank raised this on purpose'" in launched.stdout
    assert 'in fail\n    raise KeyError("the XLA rank raised this on purpose")' in launched.stdout
    assert _line(launched, "kernel environment unchanged:").endswith("True")


def _json(result: subprocess.CompletedProcess[str], prefix: str) -> dict:
    import json

    return json.loads(_line(result, prefix).removeprefix(prefix))


def test_a_data_set_that_raises_in_torch_xlas_loader_thread_fails_the_rank_with_that_error(
    launched,
):
    # torch_xla's ParallelLoader reads in a daemon thread that prints the error and ends the
    # epoch as if the data had run out: the launch finished "done" after 5 of 8 batches.
    error = _json(launched, "data error:")
    assert error.get("is ValueError") is True, error
    assert error["message"].startswith("Rank 0 (pid ")
    assert "raised ValueError: sample 20 is corrupt" in error["message"]
    assert "in __getitem__" in error["message"]


def test_numpy_values_and_dataclasses_travel_through_torch_xlas_rendezvous(launched):
    # xm.mesh_reduce unpickles with torch.load(weights_only=True), which refuses these.
    value = _json(launched, "objects:")
    assert value.get("gathered") == (
        "[[np.float64(0.0), array([0, 1, 2]), Score(name='accuracy', value=0.75)]]"
    ), value
    assert value["sent"] == "[Score(name='lr of 0', value=0.1), np.int64(7)]"
    assert value["tensor in an object"] == ["cpu", [0.0, 1.0, 2.0]]  # as xm.mesh_reduce gave them
    assert value["refused"].startswith(
        "gather_object sends each replica's object pickled, but some could not be pickled "
        "(replica 0: TypeError: cannot pickle '_thread.lock' object)"
    )
    assert value["broadcast kept"] is True  # a model's broadcast from replica 0 runs on XLA


def test_sum_mean_max_and_min_reduce_through_torch_xla(launched):
    value = _json(launched, "objects:")
    assert value.get("reduced") == {k: [3.0, -1.0] for k in ("sum", "mean", "max", "min")}, value


def test_a_loader_left_early_and_a_thread_left_running_do_not_hold_the_launch(launched):
    # torch_xla runs the rank in its process pool: at the pool worker's exit, Python would
    # wait for the thread forever; the loader's threads and DataLoader workers end at break.
    assert _json(launched, "left behind:") == {"loader_threads": [], "loader_workers": 0}
