"""Turning a rank group's outcome into the launch's return value or its exception.

The one place that words a launch's end: every path (failure, timeout, stop from the
sidebar, success) sends its ``LaunchFinished`` here.
"""

from __future__ import annotations

from typing import Any, Callable

from notebook_launcher.cell_names import name_cells
from notebook_launcher.errors import (
    LaunchStoppedError,
    LaunchTimeoutError,
    RankFailedError,
    RankFailure,
    rank_failed_error_class,
)
from notebook_launcher.launcher.events import LaunchEvent, LaunchFinished
from notebook_launcher.launcher.plan import LaunchPlan
from notebook_launcher.launcher.rank_group import Outcome
from notebook_launcher.launcher.whereabouts import report_lines
from notebook_launcher.shown_text import cut_lines


def finish(
    outcome: Outcome, plan: LaunchPlan, emit: Callable[[LaunchEvent], None], elapsed: float
) -> list[Any]:
    """The values of every rank (indexed by rank), or the exception that says why not."""
    if outcome.failures:
        emit(LaunchFinished("failed", elapsed))
        raise rank_failed_error(outcome)
    if outcome.timed_out_ranks:
        emit(LaunchFinished("timeout", elapsed))
        ranks = ", ".join(str(r) for r in outcome.timed_out_ranks)
        raise LaunchTimeoutError(
            f"the launch ran past timeout={plan.timeout:g}s; rank(s) {ranks} were still running "
            f"and have been stopped.{where_block(outcome.where) or ' '}Raise timeout= if the work "
            "needs longer, or look at where those ranks wait (a collective that other ranks never "
            "reach hangs)."
        )
    if outcome.stopped_from_outside:
        emit(LaunchFinished("stopped", elapsed))
        raise LaunchStoppedError(
            "the launch was stopped from the JupyterLab sidebar; every rank was stopped."
            + where_block(outcome.where).rstrip("\n")
        )
    emit(LaunchFinished("ok", elapsed))
    return [outcome.results[rank].value() for rank in sorted(outcome.results)]


def where_block(where: dict[int, str]) -> str:
    """The lines that say where each rank was when it was ended (empty when none was asked),
    from a new line, ending in one."""
    if not where:
        return ""
    lines = "".join(f"\n  {line}" for line in report_lines(where))
    return f" Where they were:{lines}\n"


def rank_failed_error(outcome: Outcome) -> RankFailedError:
    failures = sorted(outcome.failures, key=lambda f: f.time)
    # A rank that fails on its own (or is lost with its machine) breaks its peers'
    # connections at once, and they may report first: a closed connection is a consequence
    # whenever another rank failed for a reason of its own.
    if _is_closed_connection(failures[0]):
        cause = next((f for f in failures if f.lost), None) or next(
            (f for f in failures if not _is_closed_connection(f)), None
        )
        if cause is not None:
            failures.remove(cause)
            failures.insert(0, cause)
    root = failures[0]
    lines = [f"{_sentence(root.summary())} The other ranks were stopped."]
    early = _left_early(outcome, root)
    if early:
        lines.append(early)
    for later in failures[1:]:
        summary = later.summary()
        lines.append(_sentence(f"Afterwards, {summary[0].lower()}{summary[1:]}"))
    if root.traceback:
        shown = name_cells(root.traceback.rstrip())  # cells as the notebook numbers them
        lines += ["", f"Traceback from rank {root.rank}:", cut_lines(shown)]
    elif root.output_tail:
        lines += ["", f"Last output of rank {root.rank}:", cut_lines(root.output_tail)]
    remote = outcome.remote_exceptions.get(root.rank)
    # Where the exception itself could not travel (an attribute that cannot be pickled),
    # its type alone still makes `except ValueError` work.
    remote_type = type(remote) if remote is not None else outcome.remote_types.get(root.rank)
    if remote_type is not None and not (
        isinstance(remote_type, type) and issubclass(remote_type, BaseException)
    ):
        remote_type = None
    error = rank_failed_error_class(remote_type)("\n".join(lines), failures)
    if remote is not None:
        error.__cause__ = remote
    return error


def _left_early(outcome: Outcome, root: RankFailure) -> str | None:
    """Ranks that had already ended normally when the first one failed: often the cause
    of the failure (a peer waiting in a collective sees its connection close)."""
    # Which end the kernel noticed first is a race: a peer's closed connection fails the
    # rank waiting in a collective at once, often before the kernel has seen the peer's own
    # end. A rank that returned ended by itself (the teardown's signals give no result), so
    # where the first failure is a closed connection, every rank that returned came first.
    closed = _is_closed_connection(root)
    gone = [
        rank
        for rank, result in sorted(outcome.results.items())
        if closed or outcome.finished_at.get(rank, root.time) <= root.time
    ]
    if not gone:
        return None
    how = []
    for rank in gone:
        code = outcome.results[rank].exit_code
        how.append(
            f"rank {rank} (sys.exit({code!r}))" if code is not None else f"rank {rank} (returned)"
        )
    ranks = ", ".join(how)
    return (
        f"Before that, {ranks} had already exited early, while rank {root.rank} still needed it: "
        "a rank that leaves while the others wait in a collective (all_reduce, barrier) makes "
        "them fail with a closed connection. Make every rank run the same collectives before "
        "returning."
    )


# What torch's gloo and TCPStore say when the other end of a connection has gone.
_CLOSED_CONNECTION = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection was likely closed",
    "connectFullMesh failed",
)


def _is_closed_connection(failure: RankFailure) -> bool:
    return any(words in failure.message for words in _CLOSED_CONNECTION)


def _sentence(text: str) -> str:
    """End ``text`` with one full stop, whatever it ended with (a message may end in '.')."""
    text = text.rstrip()
    while text.endswith((".", ";", ",", ":")):
        text = text[:-1].rstrip()
    return f"{text}."
