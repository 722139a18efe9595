"""Elastic restarts: after a failure, the whole group of this machine's ranks starts again.

As in torch elastic's agent, a failure of any rank stops every local rank, and the group
is started afresh (with a fresh store round) up to ``max_restarts`` times; each restart
is announced in the cell, and the last failure is raised when restarts run out. A
timeout, an interrupt or a stop from the sidebar ends the launch without a restart.
"""

from __future__ import annotations

from notebook_launcher.errors import RankFailure
from notebook_launcher.launcher.rank_group import Outcome


def should_restart(outcome: Outcome, attempt: int, max_restarts: int) -> bool:
    """Whether the group gets another attempt after ``attempt`` (0 = the first run)."""
    return (
        bool(outcome.failures)
        and not outcome.timed_out_ranks
        and not outcome.stopped_from_outside
        and attempt < max_restarts
    )


def root_failure(outcome: Outcome) -> RankFailure:
    return min(outcome.failures, key=lambda f: f.time)


def restart_line(restart: int, max_restarts: int, failure: RankFailure) -> str:
    """``restart 1 of 3: rank 1 failed with ValueError: bad batch``."""
    return (
        f"restart {restart} of {max_restarts}: rank {failure.rank} failed with {describe(failure)}"
    )


def describe(failure: RankFailure) -> str:
    if failure.exception_type:
        return (
            f"{failure.exception_type}: {failure.message}"
            if failure.message
            else failure.exception_type
        )
    if failure.signal_name:
        return failure.signal_name
    return f"exit code {failure.exitcode}"
