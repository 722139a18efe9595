"""A session's ranks seen from the kernel: the launcher's rank group, driven command by command.

The ranks are the launcher's own (a backend starts them; ``run_rank`` gives them the
environment contract, fd-level output and the message channel), started ``with_commands``
so each also reads a command pipe; the rank target runs the session's serve loop. The
group's multiplexer is pumped from the calling thread only while the kernel waits for an
answer, so each rank's output lands, prefixed, in the cell that asked.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import threading
import time
import uuid
from typing import Any, Callable

from notebook_launcher.errors import RankFailure, SessionError
from notebook_launcher.launcher import backends
from notebook_launcher.launcher.events import LaunchObserver
from notebook_launcher.launcher.plan import LaunchPlan
from notebook_launcher.launcher.rank_group import Rank, RankGroup, RankState
from notebook_launcher.launcher.run import Emitter, rank_specs
from notebook_launcher.launcher.store import RendezvousStore, bind_listener
from notebook_launcher.session.debugging import converse
from notebook_launcher.session.protocol import (
    DebugPrompt,
    FromRank,
    Interrupt,
    Join,
    Ready,
    Reply,
    RichOutput,
    Snapshot,
    ToRank,
)
from notebook_launcher.session.rich_output import show
from notebook_launcher.session.worker import session_rank

# How long a look at the ranks waits for their answers: a side thread answers at once, so
# only a rank that is not scheduled at all (stopped, swapped out) takes longer.
_LOOK_S = 2.0


class SessionRanks:
    """Started ranks plus what it takes to talk to them; :meth:`close` frees all of it."""

    def __init__(self, plan: LaunchPlan, observers: list[LaunchObserver]) -> None:
        self.plan = plan
        self.launch_id = uuid.uuid4().hex[:12]
        self.replies: dict[tuple[int, int], Reply] = {}  # (rank, seq) -> reply
        self.ready: dict[int, Ready] = {}
        self.snapshots: dict[int, Snapshot] = {}  # each rank's latest answer to ask()
        self.answers: dict[int, int] = {}  # how many answers each rank gave so far
        self.answered = threading.Condition()  # notified as each answer comes
        self.pumping = threading.RLock()  # held by the thread that reads the ranks' messages
        self.prompts: dict[tuple[int, int], list[DebugPrompt]] = {}  # (rank, seq) -> pdb's prompts
        # What the kernel does with each message a rank sends (see protocol.FromRank).
        self._handlers: dict[type, Callable[[int, Any], None]] = {
            Reply: self._on_reply,
            Snapshot: self._on_snapshot,
            RichOutput: show,
            DebugPrompt: self._on_prompt,
            Ready: self._on_ready,
        }
        self._cleanup = contextlib.ExitStack()
        try:
            backend = backends.lookup(plan.backend)
            backends.check_supports(backend, plan.accelerator)
            if not backend.supports_sessions:
                raise SessionError(
                    f"the {backend.name!r} backend cannot keep ranks for a session: its ranks "
                    "take no commands between cells. Use notebook_launcher(..., "
                    f"backend={backend.name!r}) to run a function on them instead."
                )
            backend.check(plan)
            listener = bind_listener(plan.master_addr, plan.port)
            self._cleanup.callback(listener.close)
            store = RendezvousStore(listener, plan.world_size)
            self._cleanup.callback(store.close)
            self.group = RankGroup(
                plan,
                backend,
                rank_specs(plan, self.launch_id, store.port),
                Emitter(observers),
                launch_id=self.launch_id,
                with_commands=True,
            )
            self._cleanup.callback(self.group.close)
            self.group.start(None, target=session_rank)
            # The store's port is open to every local process: only holders of this secret
            # can use the session's keys (see sealed_store).
            join = Join(secrets.token_bytes(32))
            for rank in range(plan.num_processes):
                self.send(rank, join)
        except BaseException:
            self._cleanup.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [rank.pid for rank in self.group.ranks if rank.pid is not None]

    @property
    def exited(self) -> dict[int, RankFailure | None]:
        """Ranks that ended, with how (None: the group stopped it)."""
        failures = {failure.rank: failure for failure in self.group.outcome.failures}
        return {
            r.rank: failures.get(r.rank) for r in self.group.ranks if r.state == RankState.EXITED
        }

    def send(self, rank: int, command: ToRank) -> None:
        try:
            self.group.send(rank, command)
        except OSError:
            self.group.watch(0.0)  # the rank is gone; its end says how

    def interrupt(self, ranks: list[int], seq: int) -> None:
        """Interrupt command ``seq`` on these ranks: an Interrupt on their command pipes (for a
        rank that has not started it yet), then SIGINT to the ranks themselves (not their
        children, which are not running a cell)."""
        for index in ranks:
            rank = self.group.ranks[index]
            if rank.state == RankState.RUNNING and rank.pid is not None:
                self.send(index, Interrupt(seq))
                self.group.signal_rank(index, signal.SIGINT)

    def ask(self, ranks: list[int]) -> None:
        """Ask these ranks what they are doing (SIGUSR1); each answers with a Snapshot, also
        while its main thread is blocked in C++."""
        for index in ranks:
            rank = self.group.ranks[index]
            # Only a rank that said Ready has its answer set up: before that, SIGUSR1's
            # default action would end it.
            if rank.state == RankState.RUNNING and rank.pid is not None and index in self.ready:
                self.group.signal_rank(index, signal.SIGUSR1)

    def look(self, targets: list[int]) -> dict[int, Snapshot | None]:
        """Each target's answer to "what are you doing?" (None: no answer in time).

        From any thread: while another one reads the ranks' messages (a cell runs), this
        one waits to be told the answers came.
        """
        before = {rank: self.answers.get(rank, 0) for rank in targets}

        def answered() -> bool:
            return all(self.answers.get(rank, 0) > before[rank] for rank in targets)

        self.ask(targets)
        if self.pumping.acquire(blocking=False):
            try:
                self.pump(answered, timeout=_LOOK_S)
            finally:
                self.pumping.release()
        else:
            with self.answered:
                self.answered.wait_for(answered, timeout=_LOOK_S)
        return {
            rank: self.snapshots.get(rank) if self.answers.get(rank, 0) > before[rank] else None
            for rank in targets
        }

    def debug(
        self, target: int, seq: int, read: Callable[[str], str], write: Callable[[str], None]
    ) -> Reply | None:
        """Read the ranks' messages, answering pdb's prompts on ``target``, until its reply to
        command ``seq`` (None: a rank ended meanwhile)."""

        def ready() -> bool:
            return (target, seq) in self.replies or (target, seq) in self.prompts

        while (target, seq) not in self.replies:
            self.pump(ready, timeout=None)
            if self.any_ended():
                return None
            converse(self.prompts, target, seq, self.send, read, write)
        return self.replies.pop((target, seq))

    def stop(self) -> None:
        """Ask every rank to end (from any thread: only signals and flags)."""
        for rank in self.group.ranks:
            rank.request_stop(signal.SIGTERM)

    def any_ended(self) -> bool:
        return any(rank.state != RankState.RUNNING for rank in self.group.ranks)

    def poll(self) -> bool:
        """One look without waiting (output, messages, ends); True when a rank has ended."""
        self.group.watch(0.0)
        return self.any_ended()

    def pump(self, done: Callable[[], bool], timeout: float | None) -> None:
        """Handle output, messages and ends until ``done()``, a rank ends, or ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def until() -> bool:
            if done() or self.any_ended():
                return True
            return deadline is not None and time.monotonic() >= deadline

        self.group.run(until=until, on_message=self._on_message)

    def drain(self) -> None:
        """Show what the ranks wrote before their replies (already in the pipes), unfinished
        last lines included: a cell's output belongs to that cell."""
        self.group.watch(0.0)
        self.group.flush_partial_lines()

    def _on_message(self, rank: Rank, message: FromRank) -> None:
        handler = self._handlers.get(type(message))
        if handler is not None:
            handler(rank.rank, message)

    def _on_reply(self, rank: int, reply: Reply) -> None:
        self.replies[(rank, reply.seq)] = reply

    def _on_snapshot(self, rank: int, snapshot: Snapshot) -> None:
        with self.answered:
            self.snapshots[rank] = snapshot
            self.answers[rank] = self.answers.get(rank, 0) + 1
            self.answered.notify_all()

    def _on_prompt(self, rank: int, prompt: DebugPrompt) -> None:
        self.prompts.setdefault((rank, prompt.seq), []).append(prompt)

    def _on_ready(self, rank: int, ready: Ready) -> None:
        self.ready[rank] = ready

    def close(self) -> None:
        """Stop every rank (time-limited) and free the store, pipes and descriptors; idempotent."""
        self._cleanup.close()
