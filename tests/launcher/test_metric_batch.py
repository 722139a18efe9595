"""Log calls as columns: every call comes back as logged, and the finite flag never lies."""

from __future__ import annotations

import math
import pickle
import random

import pytest

from notebook_launcher.launcher.metric_batch import MetricBatch, numbers_of, step_of


def test_calls_with_different_names_and_steps_come_back_as_logged():
    steps = [0, None, 2**70, 3]  # a step too large for 8 bytes, and calls without one
    calls = [{"loss": 1.0, "lr": 0.1}, {"loss": 0.5}, {"acc": 0.9, "loss": 0.25}, {"lr": 0.05}]
    batch = pickle.loads(pickle.dumps(MetricBatch.of_calls(steps, calls)))
    assert list(batch.steps) == steps
    assert batch.calls() == calls
    assert list(batch.columns) == ["loss", "lr", "acc"]  # in the order first logged
    assert list(batch.steps_of(batch.columns["lr"])) == [0, 3]
    assert list(batch.columns["loss"].values) == [1.0, 0.5, 0.25]


def test_calls_of_every_mix_of_names_come_back_as_logged_in_the_order_first_logged():
    rng = random.Random(7)
    for _ in range(300):
        calls = [{name: rng.random() for name in rng.sample("abcde", rng.randint(0, 5))}
                 for _ in range(rng.randint(1, 30))]  # fmt: skip
        batch = MetricBatch.of_calls(list(range(len(calls))), calls)
        assert batch.calls() == calls
        assert list(batch.columns) == list(dict.fromkeys(name for call in calls for name in call))


def test_hundreds_of_metrics_logged_every_tenth_call_come_back_as_logged():
    # The loss every call, 200 per-layer norms every tenth: 344,000 values in one batch.
    calls = [{"loss": 1.0 / (s + 1), **({f"layer_{i}": float(i) for i in range(200)} if s % 10 == 0 else {})}
             for s in range(16384)]  # fmt: skip
    batch = MetricBatch.of_calls(list(range(16384)), calls)
    assert batch.calls() == calls
    assert list(batch.columns["layer_7"].calls) == list(range(0, 16384, 10))
    assert batch.columns["loss"].calls is not None and len(batch.columns["loss"].values) == 16384


def test_the_usual_batch_is_one_array_per_metric():
    batch = MetricBatch.of_calls(
        list(range(1000)), [{"loss": 1 / (s + 1), "lr": 0.1} for s in range(1000)]
    )
    assert [column.calls for column in batch.columns.values()] == [None, None]
    assert batch.steps_of(batch.columns["loss"]) is batch.steps
    assert batch.steps.typecode == "q" and batch.columns["loss"].values.typecode == "d"


@pytest.mark.parametrize(
    ("values", "finite"),
    [([1.0, 2.0], True), ([1.0, math.nan], False), ([math.inf, 1.0], False), ([-math.inf], False),
     ([1e308, 1e308], False)],  # the last: finite values whose sum is not; looked at one by one
)  # fmt: skip
def test_a_column_called_finite_holds_no_nan_or_inf(values, finite):
    batch = MetricBatch.of_calls(list(range(len(values))), [{"x": v} for v in values])
    assert batch.columns["x"].finite is finite


def test_what_travels_of_a_call_is_its_numbers():
    class Half:
        def __float__(self):
            return 0.5

    assert numbers_of({"loss": 1, "flag": True, "note": "text", "huge": 10**400, "half": Half(), 7: 0.25}) == {
        "loss": 1.0, "flag": 1.0, "half": 0.5, "7": 0.25,
    }  # fmt: skip


def test_steps_and_calls_must_pair_up():
    with pytest.raises(ValueError, match="2 steps for 1 calls"):
        MetricBatch.of_calls([0, 1], [{"x": 1.0}])


def test_a_step_travels_as_an_int_a_finite_float_or_none():
    import numpy as np
    import torch

    assert [step_of(s) for s in (3, np.int64(4), torch.tensor(5), 2.5, np.float32(0.5))] == [
        3,
        4,
        5,
        2.5,
        0.5,
    ]
    assert [step_of(s) for s in (None, "7", b"7", math.nan, math.inf, lambda: 1, object())] == [
        None
    ] * 7
