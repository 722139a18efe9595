"""The real torch_xla on the CPU (PJRT_DEVICE=CPU): opt-in, run by `make test-xla`.

torch_xla needs its own torch version (a multi-GB install), so it lives in `.venv-xla`;
in the default environment these tests are skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.xla

SCRIPT = Path(__file__).parent / "tpu_scripts" / "real_xla_launch.py"
ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def launched() -> subprocess.CompletedProcess[str]:
    torch_xla = pytest.importorskip("torch_xla", reason="the real torch_xla runs in .venv-xla: make test-xla")
    if str(getattr(torch_xla, "__version__", "")).endswith("+fake"):
        pytest.skip("the fake torch_xla is on the path")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)}
    env.pop("NOTEBOOK_LAUNCHER_LAUNCH_ID", None)
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=540)
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
    assert _line(launched, "error type:") == "error type: RankFailedError[KeyError] is KeyError: True"
    assert "raised KeyError: 'the XLA rank raised this on purpose'" in launched.stdout
    assert 'in fail\n    raise KeyError("the XLA rank raised this on purpose")' in launched.stdout
    assert _line(launched, "kernel environment unchanged:").endswith("True")
