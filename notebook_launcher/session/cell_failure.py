"""The error a session cell raises when it failed on some ranks: the first failure's own
story, what happened to the other ranks, and the rank's exception type for ``except``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import cloudpickle

from notebook_launcher.cell_names import name_cells
from notebook_launcher.errors import RankFailedError, RankFailure, rank_failed_error_class
from notebook_launcher.session.protocol import Reply


def cell_error(
    replies: dict[int, Reply],
    failed: list[int],
    interrupted: list[int],
    regrouped: bool,
    pids: list[int],
) -> RankFailedError:
    """Raised in the kernel: ``failed`` ranks replied with a failure, ``interrupted`` ones
    were still running when the first failure came."""
    failures = []
    for rank in failed:
        f = replies[rank].failure
        assert f is not None
        failures.append(
            RankFailure(
                rank, pids[rank], None, f.exception_type, f.message, f.traceback, time=f.time
            )
        )
    failures.sort(key=lambda f: f.time)
    root = failures[0]
    lines = [f"{root.summary()}."]
    for later in failures[1:]:
        lines.append(f"Also, {later.summary()[0].lower()}{later.summary()[1:]}.")
    stopped = [r for r in interrupted if replies[r].interrupted]
    if stopped:
        lines.append(
            f"Rank(s) {rank_names(stopped)} were still running the cell and were interrupted."
        )
    if regrouped:
        lines.append(
            "The process group was rebuilt (a collective may have been left half-done), so "
            "the next cell can use collectives again; the names defined so far are kept."
        )
    lines.append("The session is ready for the next cell.")
    failure = replies[root.rank].failure
    assert failure is not None
    # Functions and classes from earlier cells: named as the notebook numbers its cells.
    lines += ["", f"Traceback from rank {root.rank}:", name_cells(failure.traceback.rstrip())]
    remote: BaseException | None = None
    remote_type: type[BaseException] | None = None
    if failure.exception is not None:
        with contextlib.suppress(Exception):  # its class may not exist in the kernel
            remote = cloudpickle.loads(failure.exception)
            remote_type = type(remote)
    if remote_type is None and failure.exception_class is not None:
        with contextlib.suppress(Exception):
            remote_type = cloudpickle.loads(failure.exception_class)
    error = rank_failed_error_class(remote_type)("\n".join(lines), failures)
    if remote is not None:
        error.__cause__ = remote
    return error


def rank_names(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in ranks)
