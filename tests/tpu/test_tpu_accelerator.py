"""The training core on XLA replicas, under torch_xla's own multiprocessing (faked hardware)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.tpu import FAKE_XLA

SCRIPT = Path(__file__).parents[1] / "support" / "tpu_scripts" / "core_on_xla.py"
ROOT = Path(__file__).parents[2]


def _run(
    tmp_path: Path, precision: str = "no", chips: int = 2, accelerator_type: str = "v5litepod-8"
) -> list[dict]:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/tmp"),
        "PYTHONPATH": f"{FAKE_XLA}:{ROOT}",
        "PJRT_DEVICE": "TPU",
        "FAKE_TPU_CHIPS": str(chips),
        "TPU_ACCELERATOR_TYPE": accelerator_type,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), precision],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a safety net: seconds alone, minutes on a machine at load 30
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("printed once, by the main process") == 1, result.stdout
    records = [torch.load(p, weights_only=False) for p in sorted(tmp_path.glob("replica*.pt"))]
    return sorted(records, key=lambda r: r["rank"])


@pytest.mark.slow(reason="launched ranks train, compared with one process")
def test_replicas_train_to_the_weights_of_one_process_with_the_global_batch(tmp_path):
    records = _run(tmp_path)
    assert [r["rank"] for r in records] == [0, 1] and {r["world"] for r in records} == {2}
    assert {r["distributed_type"] for r in records} == {"XLA"}
    reference = torch.load(tmp_path / "reference.pt")
    for record in records:
        torch.testing.assert_close(record["weight"], reference, rtol=1e-5, atol=1e-6)
        # Gradients were averaged by torch_xla's optimizer step, batches came through its loader.
        assert record["calls"]["optimizer_step"] == 4 and record["calls"]["ParallelLoader"] == 1
        assert record["calls"]["rendezvous"] >= 1 and record["calls"]["save"] == 1
    # gather_for_metrics saw every sample once, in order, without the even_batches repeats.
    assert records[0]["seen"] == list(range(20))
    assert records[0]["objects"] == ["r0", "r1"] and records[0]["reduced"] == 3.0
    checkpoint = torch.load(tmp_path / "checkpoint.pt")
    torch.testing.assert_close(checkpoint["weight"], reference, rtol=1e-5, atol=1e-6)


@pytest.mark.slow(reason="launched ranks train, two replicas each")
def test_v3_chips_run_two_replicas_per_process_as_threads(tmp_path):
    records = _run(tmp_path, chips=1, accelerator_type="v3-8")
    assert [r["rank"] for r in records] == [0, 1] and records[0]["world"] == 2
    reference = torch.load(tmp_path / "reference.pt")
    torch.testing.assert_close(records[1]["weight"], reference, rtol=1e-5, atol=1e-6)


@pytest.mark.slow(reason="launched ranks train under the faked XLA runtime")
def test_bf16_is_the_xla_precision(tmp_path):
    records = _run(tmp_path, precision="bf16", chips=1)
    assert records[0]["mixed_precision"] == "bf16"


@pytest.mark.parametrize("precision", ["fp16", "fp8"])
def test_fp16_and_fp8_are_refused_on_xla_with_the_reason(precision):
    from notebook_launcher.accelerator import precision as core_precision
    from notebook_launcher.errors import MixedPrecisionError

    with pytest.raises(MixedPrecisionError, match=f"{precision}.*TPU"):
        core_precision.check_precision_supported(
            precision, device_kind="tpu", local_rank=0, source="Accelerator(mixed_precision=...)"
        )


def test_moving_a_model_to_a_device_that_makes_new_parameters_keeps_the_optimizer_on_them():
    # XLA, like the meta device, cannot take a CPU storage in place: Module.to makes new
    # Parameters, which an optimizer built before the move must step instead of the old ones.
    from notebook_launcher.accelerator import xla

    model = torch.nn.Linear(3, 2)
    old = list(model.parameters())
    swaps = xla.move_model(model, torch.device("meta"))
    new = list(model.parameters())
    assert [swaps[id(p)] for p in old] == new and all(p.device.type == "meta" for p in new)
