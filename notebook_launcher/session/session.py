"""``Session``: ranks that stay alive across cells, driven from the kernel one command at a time."""

from __future__ import annotations

import builtins
import numbers
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable

from notebook_launcher import registry
from notebook_launcher.defaults import effective_defaults
from notebook_launcher.errors import (
    LaunchTypeError,
    RankFailedError,
    SessionError,
)
from notebook_launcher.hardware import detect as detect_hardware
from notebook_launcher.launcher import options
from notebook_launcher.launcher.events import LaunchObserver
from notebook_launcher.launcher.pickling import dump_payload
from notebook_launcher.launcher.plan import LaunchCall, LaunchPlan, resolve_plan
from notebook_launcher.launcher.printer import TextPrinter
from notebook_launcher.launcher.start_method import KernelState
from notebook_launcher.session.capture import check_picklable
from notebook_launcher.session.completion import merge
from notebook_launcher.session.interrupts import StopPresses
from notebook_launcher.session.progress_bars import ProgressBars
from notebook_launcher.session.protocol import (
    Call,
    Command,
    Complete,
    Debug,
    Describe,
    Execute,
    Pull,
    Push,
    Reply,
    read_completions,
    read_debug,
    read_description,
    read_execute,
    read_value,
)
from notebook_launcher.session.ranks import SessionRanks
from notebook_launcher.session.roundtrip import (
    RESTART_HINT,
    WAKE_S,
    CellRoundTrip,
    Counters,
    SessionHooks,
)
from notebook_launcher.session.snapshot import Snapshot, status_row, where_text

# The session the magics run cells on (see Session.current); one kernel has one.
_magics_session: Session | None = None


def set_magics_session(session: Session | None) -> None:
    """Called by the magics as they start, replace or stop their session."""
    global _magics_session
    _magics_session = session


def current_session() -> Session | None:
    """The magics' session, or None (Session.current() raises instead)."""
    return _magics_session


class Session:
    """``num_processes`` ranks with torch.distributed set up once, kept across cells.

    Each rank has its own namespace holding ``rank``, ``local_rank``, ``world_size``,
    ``device`` and ``torch``; what code run there defines stays for later calls. Arguments
    left as None take the saved launch defaults, else the hardware's (as
    ``notebook_launcher()`` does). Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        num_processes: int | None = None,
        mixed_precision: str | None = None,
        start_method: str | None = None,
        hardware: str = "auto",
        *,
        output: str = "all",
        observers: list[LaunchObserver] | None = None,
    ) -> None:
        self.plan = make_plan(num_processes, mixed_precision, start_method, hardware, output)
        self._bars = ProgressBars(TextPrinter(self.plan.output), self.plan.output)
        self._observers: list[LaunchObserver] = [self._bars, *(observers or [])]
        self._counters = Counters()  # command sequence numbers, process group generations
        self._hooks = SessionHooks(
            end=self._end,
            death_error=self._death_error,
            stopped_from_outside=lambda: self._stopped_from_outside,
        )
        self._closed = False
        self._stopped_from_outside = False
        self._ended: str | None = None  # why the session is unusable (a rank died, ...)
        self._owned: set[str] = set()  # names some rank's own code bound
        # The ``returns`` names of the last execute(), from its first rank (returned_rank);
        # emptied when the next execute() starts, and free to be cleared by the caller.
        self.returned: dict[str, Any] = {}
        self.returned_rank: int | None = None
        # After a stop press the kernel ignores further presses until this is called with
        # the function that restores them (default: at once, when the call returns). The
        # magics pass it to IPython, so a press cannot interrupt the showing of the error.
        self.hold_interrupts: Callable[[Callable[[], None]], None] = lambda release: release()
        self._ranks: SessionRanks | None = None
        self._record: registry.RegisteredLaunch | None = None
        self._watch_stop = threading.Event()
        self._failed_rank: int | None = None  # whose failure the last failed cell reported
        self._held: StopPresses | None = None  # the last call's stop presses, until let go

        self._watcher: threading.Thread | None = None
        self._start()

    @staticmethod
    def current() -> Session:
        """The session that the magics (``%distributed start``, a ``%%distributed`` cell) run
        cells on, so that code can call its ``status()``, ``where()`` or ``run()``."""
        session = _magics_session
        if session is None:
            raise SessionError(
                "no session was started by the magics in this kernel, so Session.current() has "
                "none to give; %distributed start -n 2 (or a %%distributed cell) starts one."
            )
        return session

    # Life cycle ----------------------------------------------------------------------

    def _start(self) -> None:
        self._ended = None
        self._owned = set()
        self._stopped_from_outside = False
        self._ranks = ranks = SessionRanks(self.plan, self._observers)
        # At interpreter exit multiprocessing would wait for the ranks forever: stop them first.
        self._finalizer = weakref.finalize(self, ranks.close)
        try:
            ranks.pump(lambda: len(ranks.ready) == self.plan.num_processes, timeout=None)
            if ranks.exited:
                raise self._death_error(during="while the session started")
        except BaseException:
            self._release()
            raise
        self._record = registry.RegisteredLaunch(
            registry.LaunchRecord(
                launch_id=ranks.launch_id,
                kernel_id=registry.current_kernel_id(),
                kernel_pid=os.getpid(),
                num_processes=self.plan.num_processes,
                accelerator=self.plan.accelerator,
                mixed_precision=self.plan.mixed_precision,
                start_method=self.plan.start.method,
                state="running",
                started_at=time.time(),
                rank_pids=ranks.pids,
                kind="session",
            )
        )
        self._watch_stop.clear()
        self._watcher = threading.Thread(
            target=self._watch_sidebar,
            args=(self._record, ranks),
            daemon=True,
            name=f"notebook_launcher-session-{ranks.launch_id}",
        )
        self._watcher.start()

    def _watch_sidebar(self, record: registry.RegisteredLaunch, ranks: SessionRanks) -> None:
        """The sidebar's Stop and "where?" work between cells too: nothing else runs in the
        kernel then."""
        while not self._watch_stop.wait(WAKE_S):
            if record.stop_requested():
                self._stopped_from_outside = True
                ranks.stop()
                return
            if record.where_requested():
                try:
                    lines = self.where()
                except Exception as error:  # ended meanwhile: the sidebar says why
                    lines = [f"the ranks cannot say: {error}"]
                record.update(where=lines, where_at=time.time())

    def _release(self) -> None:
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        if self._ranks is not None:
            self._finalizer()  # closes the ranks, once
        if self._record is not None:
            self._record.close()
            self._record = None

    def close(self) -> None:
        """Stop every rank and free everything the session holds; calling it again is harmless."""
        if self._closed:
            return
        self._closed = True
        self._let_go_of_presses()
        self._release()

    def restart(self) -> None:
        """New ranks with the same settings. Every name defined on the old ranks is gone."""
        if self._closed:
            raise SessionError(
                "restart() was called on a closed session; create a new Session (or "
                "%distributed start) instead."
            )
        self._release()
        self._start()
        print(
            f"notebook_launcher: restarted the session with {self.plan.num_processes} new "
            "ranks; names defined on the old ranks are gone.",
            file=sys.stderr,
        )

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Session: {self.describe()}>"

    def describe(self) -> str:
        plan = self.plan
        device = "GPU" if plan.accelerator == "cuda" else plan.accelerator.upper()
        what = (
            f"{plan.num_processes} {device} rank{'s' if plan.num_processes != 1 else ''}, "
            f"mixed_precision={plan.mixed_precision}, start_method={plan.start.method}"
        )
        if self._closed:
            return f"{what}; closed"
        if not self.alive:
            return f"{what}; stopped: {self._why_unusable()}"
        return f"{what}; alive (pids {', '.join(str(p) for p in self.pids)})"

    @property
    def pids(self) -> list[int]:
        return [] if self._ranks is None else self._ranks.pids

    @property
    def alive(self) -> bool:
        """True while every rank is up and the session can run code."""
        if self._closed or self._ranks is None or self._ended is not None:
            return False
        if self._ranks.poll() or self._stopped_from_outside:
            self._end()
            return False
        return True

    # Running code --------------------------------------------------------------------

    def run(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``function(*args, **kwargs)`` on every rank; every rank's return value, in rank order."""
        options.check_function(function)
        payload = dump_payload(function, args, kwargs)
        replies = self._roundtrip(self._all(), lambda seq: Call(seq, payload))
        return [read_value(replies[r]) for r in self._all()]

    def execute(
        self,
        code: str,
        ranks: Sequence[int] | None = None,
        *,
        names: Mapping[str, Any] | None = None,
        returns: Sequence[str] = (),
        filename: str | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Run ``code`` on the ranks (all, or ``ranks`` in that order); the value of its last
        expression on each (None when it ends with a statement).

        ``names`` are put into each rank's namespace first; ``returns`` names are read back
        afterwards (see :attr:`returned`). A cell still running after ``timeout`` seconds is
        interrupted, and SessionTimeoutError says where each rank was.
        """
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0
        ):
            raise LaunchTypeError(
                f"timeout={timeout!r} must be a number of seconds above 0, or None."
            )
        if not isinstance(code, str):
            raise LaunchTypeError(
                f"code must be a string of Python source; got {type(code).__name__}."
            )
        targets = self._targets(ranks)
        self.returned, self.returned_rank = {}, None
        blob = check_picklable(dict(names or {}), "the cell uses")
        name = filename or f"<session cell {self._counters.seq + 1}>"
        replies = self._roundtrip(
            targets, lambda seq: Execute(seq, code, name, blob, tuple(returns)), timeout=timeout
        )
        values = []
        for position, rank in enumerate(targets):
            first = position == 0 and bool(returns)
            last, returned = read_execute(replies[rank], with_returned=first)
            values.append(last)
            if first:
                self.returned, self.returned_rank = returned, rank
        return values

    def push(self, names: Mapping[str, Any], ranks: Sequence[int] | None = None) -> None:
        """Put ``names`` into the namespace of every rank (or of ``ranks``)."""
        if not isinstance(names, Mapping) or not all(
            isinstance(k, str) and k.isidentifier() for k in names
        ):
            raise LaunchTypeError(
                f"push() takes a dict of variable names to values, such as {{'lr': 0.1}}; got {names!r}."
            )
        blob = check_picklable(dict(names), "push() was given")
        self._roundtrip(self._targets(ranks), lambda seq: Push(seq, blob))

    def pull(self, name: str, rank: int = 0) -> Any:
        """The value of ``name`` in one rank's namespace."""
        (target,) = self._targets([rank])
        return read_value(self._roundtrip([target], lambda seq: Pull(seq, name))[target])

    def show(self, *names: str, ranks: Sequence[int] | None = None) -> Any:
        """Each rank's value of ``names`` (or dotted paths such as ``model.weight.grad``),
        drawn side by side; equal values are marked, differing ones highlighted.

        Summaries are computed on the ranks, so a large tensor sends only a few kilobytes.
        Returns an ``Inspection``, which Jupyter shows as HTML (a static record) and whose
        ``stages`` hold the summaries.
        """
        from notebook_launcher.value_summaries import collect
        from notebook_launcher.widgets.inspector import Inspection

        return Inspection([("", collect(self, names, ranks))])

    def where(self) -> list[str]:
        """One line per rank: idle, or the cell, line and function its code is in now."""
        looked = self._look_at_all()
        return [where_text(rank, looked[rank]) for rank in self._all()]

    def status(self) -> list[dict[str, Any]]:
        """Each rank's state (idle, or running what for how long, and where), pid, resident
        memory, CPU % (of one core, since the last look) and, on GPU ranks, CUDA memory
        allocated and reserved by torch, as plain data. Callable from another thread while
        a cell runs."""
        looked = self._look_at_all()
        return [status_row(rank, looked[rank]) for rank in self._all()]

    def debug(self, rank: int | None = None, *, read: Callable[[str], str] | None = None) -> None:
        """pdb in a rank, at the frame that raised in its last cell, until ``q``; each line is
        asked with ``read`` (default ``input``; in a notebook: the cell's input box). The other
        ranks wait.

        ``rank`` defaults to the rank whose failure the last failed cell reported.
        """
        if rank is None:
            rank = self._failed_rank
            if rank is None:
                raise SessionError(
                    "no cell has failed on the ranks of this session, so there is no error to "
                    "debug; after a cell fails, %distributed debug (or session.debug(rank=R)) "
                    "opens pdb where it failed."
                )
        (target,) = self._targets([rank])
        ranks = self._check_usable()
        seq = self._counters.next_seq()
        with ranks.pumping:
            ranks.send(target, Debug(seq))
            # input() looked up now: a kernel replaces it while a cell runs, to ask the notebook
            reply = ranks.debug(
                target, seq, read or (lambda prompt: builtins.input(prompt)), _write
            )
            ranks.drain()
        if reply is None:
            self._end()
            raise self._death_error(during="while it was being debugged")
        if reply.failure is not None:
            raise SessionError(
                f"the debugger ended with an error on rank {target}: {reply.failure.exception_type}: "
                f"{reply.failure.message}. The session goes on."
            )
        kind, text = read_debug(reply)
        if kind == "nothing":
            raise SessionError(text)
        _write(text)

    def complete(self, token: str) -> list[tuple[str, str]]:
        """Completions of ``token`` (``x``, ``model.lay``) from every rank's namespace, as
        (text, type); a name only some ranks have says which."""
        replies = self._roundtrip(self._all(), lambda seq: Complete(seq, token))
        return merge([read_completions(replies[r]) for r in self._all()])

    def describe_name(self, name: str) -> str | None:
        """Type, signature and docstring of ``name`` on the first rank that has it (None: none has)."""
        replies = self._roundtrip(self._all(), lambda seq: Describe(seq, name))
        for rank in self._all():
            text = read_description(replies[rank])
            if text is not None:
                return text if rank == 0 else f"(from rank {rank}; rank 0 has no {name})\n{text}"
        return None

    def _look_at_all(self) -> dict[int, Snapshot | None]:
        ranks = self._ranks
        if ranks is None or self._closed:
            return self._check_usable().look(self._all())  # raises, saying why
        if not ranks.pumping.acquire(blocking=False):
            return ranks.look(self._all())  # a cell runs: its thread reads the answers
        try:
            return self._check_usable().look(self._all())
        finally:
            ranks.pumping.release()

    @property
    def owned_names(self) -> set[str]:
        """Names that code on the ranks bound (or that were pushed): notebook values never replace them."""
        return set(self._owned)

    def _all(self) -> list[int]:
        return list(range(self.plan.num_processes))

    def _targets(self, ranks: Iterable[int] | int | None) -> list[int]:
        if ranks is None:
            return self._all()
        given: list[Any] = [ranks] if isinstance(ranks, numbers.Integral) else list(ranks)  # type: ignore[arg-type]
        world = self.plan.num_processes
        for rank in given:
            if (
                isinstance(rank, bool)
                or not isinstance(rank, numbers.Integral)
                or not 0 <= int(rank) < world
            ):
                raise LaunchTypeError(
                    f"ranks={given!r}: {rank!r} is not a rank of this session, which has "
                    f"ranks 0 to {world - 1}."
                )
        if not given or len(set(given)) != len(given):
            raise LaunchTypeError(
                f"ranks={given!r} must name at least one rank, each once (ranks 0 to {world - 1})."
            )
        return [int(r) for r in given]

    # One command on some ranks, with every way it can end -----------------------------

    def _check_usable(self) -> SessionRanks:
        if self._closed:
            raise SessionError(
                "the session is closed; create a new Session (or %distributed start) to run code on ranks."
            )
        if not self.alive or self._ranks is None:
            raise SessionError(
                f"the session has no usable ranks: {self._why_unusable()}. {RESTART_HINT}; names defined on the old ranks are lost."
            )
        return self._ranks

    def _why_unusable(self) -> str:
        if self._stopped_from_outside:
            return "it was stopped from the JupyterLab sidebar"
        if self._ended is not None:
            return self._ended
        return "its ranks are gone"

    def _roundtrip(
        self, targets: list[int], make: Callable[[int], Command], timeout: float | None = None
    ) -> dict[int, Reply]:
        ranks = self._check_usable()
        self._bars.new_cell()
        self._let_go_of_presses()
        trip = CellRoundTrip(ranks, self._all(), self._counters, self._hooks)
        try:
            return trip.run(targets, make, timeout)
        finally:
            self._owned.update(trip.owned)
            if trip.failed_rank is not None:
                self._failed_rank = trip.failed_rank
            if trip.presses.installed:
                trip.presses.returned()
                self._held = trip.presses
                self.hold_interrupts(trip.presses.release)

    def _let_go_of_presses(self) -> None:
        """The last call's hold on stop presses ends when the next call starts, whoever was
        to release it (a widget's callback has no cell whose end would)."""
        held, self._held = self._held, None
        if held is not None and threading.current_thread() is threading.main_thread():
            held.release()

    def _end(self, reason: str = "its ranks were stopped") -> None:
        """A rank died (or the session was stopped): the others are stopped, the session unusable."""
        ranks = self._ranks
        if ranks is not None and self._ended is None:
            failures = [f for f in ranks.exited.values() if f is not None]
            if failures:
                self._ended = min(failures, key=lambda f: f.time).summary()
        if self._ended is None:
            self._ended = reason
        self._release()

    def _death_error(self, during: str) -> RankFailedError:
        ranks = self._ranks
        failures = sorted(
            (f for f in (ranks.exited.values() if ranks else ()) if f is not None),
            key=lambda f: f.time,
        )
        if not failures:
            return RankFailedError(f"the session's ranks ended {during}. {RESTART_HINT}.", [])
        root = failures[0]
        lines = [
            f"{root.summary()} {during}; the session's other ranks were stopped. {RESTART_HINT}; "
            "names defined on the old ranks are lost."
        ]
        if root.traceback:
            lines += ["", f"Traceback from rank {root.rank}:", root.traceback.rstrip()]
        elif root.output_tail:
            lines += ["", f"Last output of rank {root.rank}:", root.output_tail]
        return RankFailedError("\n".join(lines), failures)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def make_plan(
    num_processes: Any, mixed_precision: Any, start_method: Any, hardware: Any, output: Any = "all"
) -> LaunchPlan:
    """The launcher's own plan (same checks, defaults and messages) for the session's ranks."""
    call = LaunchCall(
        num_processes=num_processes,
        mixed_precision=mixed_precision,
        hardware=hardware,
        start_method=start_method,
        output=output,
        return_all=True,
        monitor_interval=WAKE_S,
    )
    return resolve_plan(call, effective_defaults(), detect_hardware(), KernelState.detect())
