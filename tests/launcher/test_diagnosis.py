"""The diagnosis of a launch, from the numbers its ranks report (medians per step, seconds)."""

from __future__ import annotations

import pytest

from notebook_launcher.launcher.diagnosis import diagnose


def steps(median: float, compute: float, collectives: float | None, data: float = 0.0) -> dict:
    return {
        "count": 20,
        "median_s": median,
        "compute_s": compute,
        "collectives_s": collectives,
        "data_s": data,
    }


def test_a_launch_that_waits_in_all_reduce_is_communication_bound_with_its_share():
    found = diagnose({0: steps(0.30, 0.09, 0.21), 1: steps(0.30, 0.10, 0.20)}, 2)
    assert found is not None and found.kind == "communication-bound"
    assert found.collectives_share == pytest.approx(0.2 / 0.3)
    # one rank would compute 2 x 0.095 s for the same samples, against 0.30 s for two
    assert found.speedup == pytest.approx(2 * 0.095 / 0.30)
    assert found.sentence.startswith(
        "Communication-bound: every rank waits in collectives for at least 67% of each step "
        "(205 ms of 300 ms), so 2 ranks give about 0.6x one; one rank would be faster: use "
        "fewer ranks, or all-reduce less often with gradient accumulation"
    )
    assert "bf16" not in found.sentence  # no compression hook advice for CPU ranks


def test_communication_advice_on_gpus_names_the_bf16_compression_hook():
    found = diagnose({0: steps(0.1, 0.06, 0.04), 1: steps(0.1, 0.06, 0.04)}, 2, "cuda")
    assert found is not None and found.kind == "communication-bound"
    assert "2 ranks give about 1.2x one" in found.sentence
    assert "one rank would be faster" not in found.sentence
    assert "bf16_compress_hook" in found.sentence


def test_a_launch_that_mostly_computes_is_compute_bound_with_its_speedup():
    found = diagnose({r: steps(1.0, 0.95, 0.05) for r in range(4)}, 4)
    assert found is not None and found.kind == "compute-bound"
    assert found.speedup == pytest.approx(3.8)
    assert found.sentence == (
        "Compute-bound: 95% of each step (1.00 s) computes, 5% waits in collectives, "
        "so 4 ranks give about 3.8x one."
    )


def test_one_rank_slower_than_the_others_is_a_straggler_not_communication():
    # The fast ranks wait for rank 2 in the all-reduce; rank 2 itself hardly waits.
    found = diagnose(
        {0: steps(0.2, 0.10, 0.10), 1: steps(0.2, 0.10, 0.10), 2: steps(0.2, 0.19, 0.01)}, 3
    )
    assert found is not None and found.kind == "straggler"
    assert found.sentence.startswith(
        "A straggler: rank 2 computes 1.9x as long as the others (190 ms against 100 ms a step)"
    )


def test_ranks_waiting_for_their_batches_are_input_bound():
    found = diagnose({0: steps(0.5, 0.2, 0.05, 0.25), 1: steps(0.5, 0.2, 0.05, 0.25)}, 2)
    assert found is not None and found.kind == "input-bound"
    assert found.sentence.startswith(
        "Input-bound: the ranks wait 50% of each step (500 ms) for their next batch, so 2 ranks "
        "give about 1.8x one; give the DataLoader workers"
    )


def test_no_steps_means_no_diagnosis_and_no_error():
    assert diagnose({}, 2) is None
    assert diagnose({0: None, 1: None}, 2) is None


def test_untimed_collectives_give_no_verdict():
    found = diagnose({0: steps(0.3, 0.3, None), 1: steps(0.3, 0.3, None)}, 2)
    assert found is not None and found.kind == "unknown" and found.speedup is None
    assert "was not timed" in found.sentence


def test_one_rank_says_what_it_waits_for():
    found = diagnose({0: steps(0.2, 0.19, 0.0, 0.01)}, 1)
    assert found is not None and found.kind == "compute-bound" and found.speedup is None
    assert (
        found.sentence == "One rank, compute-bound: each step of 200 ms spends 5% waiting for data."
    )
