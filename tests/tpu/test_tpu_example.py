"""The Kaggle TPU example runs top to bottom on CPU and says what it would do on a TPU."""

from __future__ import annotations

import pytest

from tests.test_examples import execute, streams

pytestmark = pytest.mark.kernel


def test_the_kaggle_tpu_example_runs_on_cpu_and_says_what_a_tpu_would_do():
    outputs = "\n".join(streams(execute("04_kaggle_tpu.ipynb")))
    assert "no TPU on this machine; Kaggle's TPU v5e-8 would show:" in outputs
    assert "a launch here starts 2 rank(s) on CPU" in outputs
    assert "fp16 on a TPU: fp16 is not supported on TPU; use bf16" in outputs
    assert (
        "[rank0]: epoch 3: loss" in outputs
        and "[rank1]: rank 1 of 2 ran on cpu (MULTI_CPU, bf16)" in outputs
    )
    learned = next(line for line in outputs.splitlines() if line.startswith("learned:"))
    weights = [float(w) for w in learned.split("[")[1].rstrip("]").split(",")]
    assert all(abs(w - target) < 0.5 for w, target in zip(weights, range(1, 9)))
    assert (
        "num_processes=3 cannot run on this TPU: torch_xla starts either one process per chip, all 8"
        in outputs
    )
