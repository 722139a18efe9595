"""What limits a launch, in one sentence, from its ranks' step anatomy.

A pure function of the numbers the ranks' Accelerators report (medians per step: the
whole step, computing, waiting in collectives, waiting for the data loader), so that the
dashboard, the record, the text table and the tests all say the same thing.

The estimate of N ranks against one: each rank computes its own batch, so one rank would
need N times a rank's computing and data time for the same samples, while N ranks need
one step each. The ratio is what N ranks buy; waiting in collectives is what they pay.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from typing import Any

# Every rank waits at least this share of each step in collectives: the launch is bound by
# communication (N ranks then give at most 0.7 N times one).
COMMUNICATION_SHARE = 0.3
INPUT_SHARE = 0.3  # the ranks wait this share of each step for their next batch
STRAGGLER_RATIO = 1.3  # one rank's computing against the median of the others'


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    kind: str  # "communication-bound", "input-bound", "compute-bound", "straggler", "unknown"
    sentence: str
    speedup: float | None  # N ranks over one, estimated; None with one rank or no verdict
    collectives_share: float | None  # of each step, waited by every rank
    data_share: float


def diagnose(
    steps: Mapping[int, Mapping[str, Any] | None], world_size: int, accelerator: str = "cpu"
) -> Diagnosis | None:
    """The diagnosis of a launch whose ranks reported ``steps`` (rank -> summary, or None
    for a rank that took no step through the Accelerator); None when none did."""
    ranks = {rank: s for rank, s in steps.items() if s and s.get("count")}
    if not ranks:
        return None
    step_s = statistics.median(float(s["median_s"]) for s in ranks.values())
    if step_s <= 0:
        return None
    compute = {rank: float(s["compute_s"]) for rank, s in ranks.items()}
    data_share = statistics.median(
        float(s["data_s"]) / float(s["median_s"]) for s in ranks.values()
    )
    compute_s = statistics.median(compute.values())
    data_s = statistics.median(float(s["data_s"]) for s in ranks.values())
    step = _seconds(step_s)
    if world_size <= 1:
        kind = "input-bound" if data_share >= INPUT_SHARE else "compute-bound"
        sentence = (
            f"One rank, {kind}: each step of {step} spends {_pct(data_share)} waiting for data"
            + (f"; {_INPUT_ADVICE}." if kind == "input-bound" else ".")
        )
        return Diagnosis(kind, sentence, None, None, data_share)
    if any(s.get("collectives_s") is None for s in ranks.values()):
        return Diagnosis(
            "unknown",
            f"{world_size} ranks, each step {step}: the gradients' reduction was not timed (FSDP2, "
            "or a comm hook registered before prepare()), so what limits the launch is not known.",
            None,
            None,
            data_share,
        )
    collectives_share = min(
        float(s["collectives_s"]) / float(s["median_s"]) for s in ranks.values()
    )
    speedup = world_size * min(1.0, (compute_s + data_s) / step_s)
    gives = f"{world_size} ranks give about {speedup:.1f}x one"
    slowest = max(compute, key=lambda r: compute[r])
    others = [c for r, c in compute.items() if r != slowest]
    ratio = compute[slowest] / statistics.median(others) if others and min(others) > 0 else 1.0
    if collectives_share >= COMMUNICATION_SHARE:
        kind = "communication-bound"
        waited = statistics.median(float(s["collectives_s"]) for s in ranks.values())
        sentence = (
            f"Communication-bound: every rank waits in collectives for at least "
            f"{_pct(collectives_share)} of each step ({_seconds(waited)} of {step}), so {gives}; "
            + _communication_advice(speedup, accelerator)
        )
    elif ratio >= STRAGGLER_RATIO:
        kind = "straggler"
        sentence = (
            f"A straggler: rank {slowest} computes {ratio:.1f}x as long as the others "
            f"({_seconds(compute[slowest])} against {_seconds(statistics.median(others))} a step), "
            f"and they wait for it in every collective, so {gives}; look for what slows that rank "
            "(another process on its device, bigger batches, a slower device)."
        )
    elif data_share >= INPUT_SHARE:
        kind = "input-bound"
        sentence = (
            f"Input-bound: the ranks wait {_pct(data_share)} of each step ({step}) for their "
            f"next batch, so {gives}; {_INPUT_ADVICE}."
        )
    else:
        kind = "compute-bound"
        sentence = (
            f"Compute-bound: {_pct(1 - collectives_share - data_share)} of each step ({step}) "
            f"computes, {_pct(collectives_share)} waits in collectives, so {gives}."
        )
    return Diagnosis(kind, sentence, speedup, collectives_share, data_share)


_INPUT_ADVICE = (
    "give the DataLoader workers (num_workers=2 or more, persistent_workers=True) or "
    "prepare the data once before training"
)


def _communication_advice(speedup: float, accelerator: str) -> str:
    ways = [
        "gradient accumulation (accelerator.accumulate, which skips the all-reduce with "
        "no_sync until the last micro-batch)",
        "a bigger batch per rank",
    ]
    if accelerator == "cuda":
        ways.append(
            "a bf16 compression hook (model.register_comm_hook(None, bf16_compress_hook) from "
            "torch.distributed.algorithms.ddp_comm_hooks.default_hooks)"
        )
    all_reduce_less = "all-reduce less often with " + ", ".join(ways[:-1]) + " or " + ways[-1]
    if speedup < 1:
        return f"one rank would be faster: use fewer ranks, or {all_reduce_less}."
    return f"{all_reduce_less}."


def _pct(share: float) -> str:
    return f"{max(0.0, share) * 100:.0f}%"


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.2f} s"
    return f"{value * 1000:.3g} ms"
