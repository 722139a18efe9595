"""One command on some of a session's ranks, with every way it can end.

A :class:`CellRoundTrip` lives for one call: it sends the command, waits for every answer,
a rank's death, the stop button or the deadline, interrupts the ranks still running when
one fails, has every rank rebuild its process group when a collective was cut short, and
turns the outcome into the value or the error the call raises. What it learned on the way
(where the ranks were when stopped, whether the deadline passed) is its own, not the
session's.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable

from notebook_launcher.errors import (
    LaunchStoppedError,
    RankFailedError,
    SessionError,
    SessionTimeoutError,
)
from notebook_launcher.session.cell_failure import cell_error, rank_names
from notebook_launcher.session.interrupts import StopPresses
from notebook_launcher.session.protocol import Command, Regroup, Reply
from notebook_launcher.session.ranks import SessionRanks
from notebook_launcher.session.snapshot import where_text

# While waiting for an answer the kernel wakes this often (to warn about ranks that ignore
# an interrupt); there is no limit on how long a cell may run.
WAKE_S = 0.5
STUCK_AFTER_S = 5.0  # after an interrupt: say so when ranks are not back by then
RESTART_HINT = "Restart the session (session.restart(), or %distributed restart) for new ranks"


@dataclasses.dataclass
class Counters:
    """The session's numbering: every command's sequence number, every group's generation."""

    seq: int = 0
    generation: int = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def next_generation(self) -> int:
        self.generation += 1
        return self.generation


@dataclasses.dataclass(frozen=True)
class SessionHooks:
    """What a round trip needs of its session beyond the ranks."""

    end: Callable[[str], None]  # the session is unusable from now on, for this reason
    death_error: Callable[[str], RankFailedError]  # a rank died: the error, "during" what
    stopped_from_outside: Callable[[], bool]  # the sidebar's Stop was pressed


class CellRoundTrip:
    def __init__(
        self, ranks: SessionRanks, world: list[int], counters: Counters, hooks: SessionHooks
    ) -> None:
        self.ranks = ranks
        self.world = world
        self.counters = counters
        self.hooks = hooks
        self.presses = StopPresses()
        self.stopped_where: list[str] = []  # where the ranks were when the cell was stopped
        self.timed_out = False  # the cell ran past its timeout
        self.owned: set[str] = set()  # names the ranks' code bound
        self.failed_rank: int | None = None  # whose failure the cell's error reports

    def run(
        self, targets: list[int], make: Callable[[int], Command], timeout: float | None = None
    ) -> dict[int, Reply]:
        ranks = self.ranks
        seq = self.counters.next_seq()
        ranks.pumping.acquire()
        try:
            for rank in targets:
                ranks.send(rank, make(seq))
            deadline = None if timeout is None else time.monotonic() + timeout
            replies, user_interrupt, still_running = self._collect(seq, targets, deadline)
            ranks.drain()
            for reply in replies.values():
                self.owned.update(reply.owned)
            # A cell that failed or was interrupted on some rank may have left a collective
            # half-done (queued on one rank, never joined by another): every rank replaces its
            # process groups, so the next cell's collectives pair up again.
            regrouped = len(self.world) > 1 and any(
                reply.failure is not None or reply.group_broken for reply in replies.values()
            )
            if regrouped:
                self._regroup()
            if user_interrupt or self.presses.installed:
                raise KeyboardInterrupt(
                    f"the cell was interrupted on rank(s) {rank_names(targets)}"
                    + ("; the process group was rebuilt" if regrouped else "")
                    + "; the session is ready for the next cell."
                    + self._where_stopped()
                )
            if self.timed_out:
                raise SessionTimeoutError(
                    f"the cell ran past its timeout of {timeout:g}s and was interrupted on rank(s) "
                    f"{rank_names(r for r in targets if replies[r].interrupted)}"
                    + ("; the process group was rebuilt" if regrouped else "")
                    + "; the session is ready for the next cell."
                    + self._where_stopped()
                )
            failed = [
                r for r in targets if replies[r].failure is not None and not replies[r].interrupted
            ]
            if failed:
                self.failed_rank = min(failed, key=lambda r: replies[r].failure.time)  # type: ignore[union-attr]
                raise cell_error(replies, failed, still_running, regrouped, ranks.pids)
            return replies
        finally:
            ranks.pumping.release()

    def _collect(
        self, seq: int, targets: list[int], deadline: float | None
    ) -> tuple[dict[int, Reply], bool, list[int]]:
        """Wait for every target's answer, a rank's death, an interrupt or the deadline."""
        ranks, presses = self.ranks, self.presses
        pending = list(targets)
        replies: dict[int, Reply] = {}
        user_interrupt = False
        interrupted_at: float | None = None
        interrupted: list[int] = []  # still running when another rank failed
        warned = False
        while pending:
            wake = WAKE_S
            if deadline is not None and interrupted_at is None:
                wake = max(min(WAKE_S, deadline - time.monotonic()), 0.001)
            try:
                ranks.pump(lambda: any((r, seq) in ranks.replies for r in pending), timeout=wake)
            except KeyboardInterrupt:
                if user_interrupt:  # pressed again after the ranks were declared stuck
                    raise self._stopped_stuck(pending) from None
                user_interrupt = True
                presses.install()  # later presses are counted, not raised
                if interrupted_at is None:
                    self._note_where(pending)
                ranks.interrupt(pending, seq)
                interrupted_at = time.monotonic()
                continue
            if (
                deadline is not None
                and interrupted_at is None
                and pending
                and time.monotonic() >= deadline
            ):
                self.timed_out = True
                self._note_where(pending)
                ranks.interrupt(pending, seq)
                interrupted_at = time.monotonic()
            for rank in list(pending):
                reply = ranks.replies.pop((rank, seq), None)
                if reply is None:
                    continue
                replies[rank] = reply
                pending.remove(rank)
                if (
                    reply.failure is not None
                    and not reply.interrupted
                    and interrupted_at is None
                    and pending
                ):
                    interrupted = list(pending)
                    ranks.interrupt(pending, seq)
                    interrupted_at = time.monotonic()
            stopped_from_outside = self.hooks.stopped_from_outside()
            if ranks.exited or stopped_from_outside:
                self.hooks.end("its ranks were stopped")
                if stopped_from_outside:
                    raise LaunchStoppedError(
                        "the session was stopped from the JupyterLab sidebar; its ranks are gone. "
                        f"{RESTART_HINT}."
                    )
                raise self.hooks.death_error("while running the cell")
            if (
                interrupted_at is not None
                and not warned
                and time.monotonic() - interrupted_at > STUCK_AFTER_S
            ):
                warned = True
                presses.ending = True
                print(
                    f"notebook_launcher: rank(s) {rank_names(pending)} did not stop within "
                    f"{STUCK_AFTER_S:g}s of the interrupt. Interrupt the kernel again to stop "
                    "every rank (the session then needs a restart).",
                    file=sys.stderr,
                )
        return replies, user_interrupt, interrupted

    def _regroup(self) -> None:
        """Every rank replaces its process groups, after a collective was cut short."""
        ranks, presses, everyone = self.ranks, self.presses, self.world
        generation = self.counters.next_generation()
        seq = self.counters.next_seq()
        for rank in everyone:
            ranks.send(rank, Regroup(seq, generation))
        pressed_at: float | None = None
        while not all((r, seq) in ranks.replies for r in everyone) and not ranks.any_ended():
            try:
                ranks.pump(lambda: all((r, seq) in ranks.replies for r in everyone), timeout=WAKE_S)
            except KeyboardInterrupt:
                if pressed_at is not None:  # pressed again after the ranks were declared stuck
                    raise self._stopped_stuck(everyone) from None
                presses.install()
                pressed_at = time.monotonic()
            if (
                pressed_at is not None
                and not presses.ending
                and time.monotonic() - pressed_at > STUCK_AFTER_S
            ):
                presses.ending = True
                print(
                    f"notebook_launcher: the process group was not rebuilt within {STUCK_AFTER_S:g}s "
                    "of the interrupt. Interrupt the kernel again to stop every rank (the session "
                    "then needs a restart).",
                    file=sys.stderr,
                )
        replies = [ranks.replies.pop((r, seq), None) for r in everyone]
        if ranks.exited or any(reply is None or reply.failure is not None for reply in replies):
            why = next(
                (
                    f" (rank {r}: {reply.failure.exception_type}: {reply.failure.message})"
                    for r, reply in zip(everyone, replies)
                    if reply is not None and reply.failure is not None
                ),
                "",
            )
            self.hooks.end("its process group could not be rebuilt")
            raise SessionError(
                "a collective was interrupted and left the process group broken, and it could "
                f"not be rebuilt{why}. {RESTART_HINT}; names defined on the old ranks are lost."
            )

    def _note_where(self, pending: list[int]) -> None:
        """Where the ranks are, looked at before an interrupt unwinds their stacks."""
        looked = self.ranks.look(pending)
        self.stopped_where = [where_text(rank, looked[rank]) for rank in pending]

    def _where_stopped(self) -> str:
        if not self.stopped_where:
            return ""
        return "\nWhere each rank was when it was stopped:\n" + "\n".join(self.stopped_where)

    def _stopped_stuck(self, pending: list[int]) -> KeyboardInterrupt:
        """The stop button, pressed again after the ranks did not come back: end the session."""
        self.hooks.end(
            f"it was stopped from the notebook while rank(s) {rank_names(pending)} did not come back "
            "from an interrupt"
        )
        return KeyboardInterrupt(
            f"stopped every rank of the session: rank(s) {rank_names(pending)} did not come back from "
            f"the interrupt. {RESTART_HINT}; names defined on the old ranks are lost."
            + self._where_stopped()
        )
