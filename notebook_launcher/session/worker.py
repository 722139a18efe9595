"""The rank side of a session: set up once, then run the kernel's commands until told to stop.

``serve`` is the function the launcher's rank runner calls, so a session rank gets the
launcher's environment contract, output redirection at fd level, kernel-death handling and
failure reporting unchanged; what is added here is a loop over commands and a namespace
that lives across cells.
"""

from __future__ import annotations

import ast
import builtins
import collections
import contextlib
import linecache
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from types import CodeType
from typing import TYPE_CHECKING, Any, Callable

import cloudpickle

from notebook_launcher import rank_env
from notebook_launcher.launcher import rank as rank_runner
from notebook_launcher.session import rich_output
from notebook_launcher.session.completion import complete, describe
from notebook_launcher.session.debugging import LastFailure, post_mortem
from notebook_launcher.session.groups import GroupTracker
from notebook_launcher.session.protocol import (
    Call,
    Command,
    Complete,
    Debug,
    Describe,
    Execute,
    FromRank,
    Interrupt,
    Join,
    Pull,
    Push,
    Ready,
    Regroup,
    RemoteRepr,
    Reply,
    Shutdown,
    completions_value,
    debug_value,
    description_value,
    execute_value,
)
from notebook_launcher.session.rank_signals import SignalWatch, nothing_to_do_here
from notebook_launcher.session.snapshot import Running, SnapshotTaker
from notebook_launcher.stack_location import cell_label

if TYPE_CHECKING:
    from notebook_launcher.launcher.backends.base import RankEnds
    from notebook_launcher.launcher.rank import RankSpec

BASE_NAMES = ("rank", "local_rank", "world_size", "device", "torch")


def session_rank(spec: RankSpec, payload: Any, ends: RankEnds) -> None:
    """Rank target: the launcher's own rank runner, running the serve loop on the command pipe."""
    assert ends.commands is not None  # the group was started with_commands
    rank_runner.run_rank(spec, (serve, (ends.commands,), {}), ends)


def serve(commands: Connection) -> None:
    """Process target (through the launcher's ``run_rank``): one rank of a session."""
    try:
        join = commands.recv()  # the kernel sends it right after starting the rank
    except EOFError:
        return  # the kernel is gone
    if not isinstance(join, Join):
        raise TypeError(f"a session rank expects Join first; got {join!r}")
    worker = Worker(join.secret)
    send(Ready(os.getpid(), str(worker.namespace["device"])))
    worker.loop(commands)


class Worker:
    def __init__(self, secret: bytes) -> None:
        # SIGUSR1 asks what the rank is doing; only the side thread takes it, so a main
        # thread inside a C++ collective is never woken by it (see SignalWatch). Blocked
        # before torch starts its threads, which inherit the mask.
        signal.signal(signal.SIGUSR1, nothing_to_do_here)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        import torch
        import torch.distributed as dist

        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        self.accelerator = os.environ.get(rank_env.ACCELERATOR, "cpu")
        device = torch.device(f"cuda:{local_rank}" if self.accelerator == "cuda" else "cpu")
        self.namespace: dict[str, Any] = {
            "__name__": "__main__",
            "__builtins__": builtins,
            "rank": self.rank,
            "local_rank": local_rank,
            "world_size": self.world_size,
            "device": device,
            "torch": torch,
        }
        self.injected: dict[str, Any] = {}  # notebook values put in by the kernel, by name
        self._dist = dist
        self._secret = secret
        self._store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            self.world_size,
            is_master=False,
            timeout=timedelta(seconds=300),
        )
        self.groups = GroupTracker(dist)
        self._init_group(0)
        rich_output.start(send)
        self.running: Running | None = None  # the command the main thread runs now
        self.cell_files: set[str] = set()  # the names cells run under (see run_cell)
        self.last_failure: LastFailure | None = None  # of the last cell (or call), for the debugger
        self.last_ran: str | None = None  # what the last cell (or call) was
        self._snapshots = SnapshotTaker(threading.main_thread().ident or 0)
        self.interrupts = SignalWatch(self._break_group, self._send_snapshot)
        self._commands: Connection | None = None  # the kernel's commands, once serving
        self._waiting: collections.deque[Command] = collections.deque()  # read early, not run yet
        # What each command does; its reply's value (see protocol for each shape).
        self._handlers: dict[type, Callable[[Any], bytes | None]] = {
            Execute: self._execute,
            Call: self._call,
            Push: self._push,
            Pull: self._pull,
            Regroup: lambda command: self._regroup(command.generation),
            Complete: lambda command: completions_value(complete(self.namespace, command.token)),
            Describe: lambda command: description_value(describe(self.namespace, command.name)),
            Debug: lambda command: debug_value(*self._debug(command.seq)),
        }

    # The process group -------------------------------------------------------------

    def _init_group(self, generation: int) -> None:
        from notebook_launcher.launcher.sealed_store import SealedStore

        backend = "nccl" if self.accelerator == "cuda" else "gloo"
        # Held here too: torch keeps only the C++ half of a Store written in Python.
        self._sealed_store = SealedStore(self._store, self._secret, generation)
        self.groups.init_default(
            backend=backend,
            store=self._sealed_store,
            rank=self.rank,
            world_size=self.world_size,
            device_id=self.namespace["device"] if backend == "nccl" else None,
        )
        self.group_broken = False

    def _break_group(self) -> None:
        """Make a collective that waits for a rank that will never come fail now, in any of
        the rank's groups."""
        self.group_broken = True
        if self.accelerator == "cuda":
            self.groups.abort()
        else:
            # Gloo has no working abort for a pending wait; cutting its peer connections
            # ends the wait with "Connection closed by peer" at once.
            self.groups.cut()

    def _regroup(self, generation: int) -> None:
        # A collective may still be queued in an old group (the cell was interrupted around
        # it); cut it off first, or destroying the group would wait for it forever.
        self._break_group()
        self.groups.rebuild(lambda: self._init_group(generation), self.namespace)

    # Commands ------------------------------------------------------------------------

    def loop(self, commands: Connection) -> None:
        self._commands = commands
        while True:
            try:
                command: Command = self._waiting.popleft() if self._waiting else commands.recv()
            except EOFError:
                return  # the kernel is gone
            except KeyboardInterrupt:
                continue  # an interrupt that came after the cell had ended
            if isinstance(command, Interrupt):
                continue  # of a command that has ended: the signal did what was needed
            if isinstance(command, Shutdown):
                send(Reply(command.seq))
                return
            send(self.handle(command))

    def _send_snapshot(self) -> None:
        """From the side thread, while the main thread does whatever it does."""
        with contextlib.suppress(Exception):  # a look must never harm the rank
            send(
                self._snapshots.take(
                    self.running, self.cell_files.__contains__, self.namespace["device"]
                )
            )

    def handle(self, command: Command) -> Reply:
        self.running = Running(_what(command), time.monotonic())
        if isinstance(command, (Execute, Call)):
            self.last_failure, self.last_ran = None, self.running.what
        try:
            with self.interrupts.running():
                if self._interrupt_queued(command.seq):
                    raise KeyboardInterrupt  # before it started: its signal found no cell
                value = self._run(command)
        except BaseException as error:
            # A collective cut off by the interrupt fails with gloo's own error, raised before
            # or instead of the KeyboardInterrupt: either way the kernel's interrupt ended it.
            interrupted = isinstance(error, KeyboardInterrupt) or self.interrupts.signalled
            if isinstance(command, (Execute, Call)) and not interrupted:
                self.last_failure = LastFailure(
                    self.running.what, rank_runner.user_frames(error.__traceback__)
                )
            return Reply(
                command.seq,
                failure=rank_runner.failure_record(error),
                interrupted=interrupted,
                group_broken=self.group_broken,
                owned=self._owned(),
            )
        finally:
            if isinstance(command, Execute):
                with contextlib.suppress(Exception):  # a figure that cannot be drawn
                    rich_output.flush_figures()
            self.running = None
            _flush()
        return Reply(command.seq, value=value, group_broken=self.group_broken, owned=self._owned())

    def _interrupt_queued(self, seq: int) -> bool:
        """Whether the kernel interrupted command ``seq`` before this rank started it.

        An Interrupt for an earlier command is stale and dropped; anything else queued is
        kept, in order, for the loop to run next.
        """
        commands = self._commands
        interrupted = False
        with self.interrupts.whole_messages():  # what was read is kept, interrupt or not
            while commands is not None and commands.poll():
                queued = commands.recv()
                if isinstance(queued, Interrupt):
                    interrupted = interrupted or queued.seq == seq
                else:
                    self._waiting.append(queued)
        return interrupted

    def _run(self, command: Command) -> bytes | None:
        handler = self._handlers.get(type(command))
        if handler is None:
            raise TypeError(f"unknown command {command!r}")
        return handler(command)

    def _execute(self, command: Execute) -> bytes:
        self._inject(cloudpickle.loads(command.names))
        self.cell_files.add(command.filename)
        last = run_cell(command.code, command.filename, self.namespace)
        returned = {}
        for name in command.returns:
            if name not in self.namespace:
                raise NameError(
                    f"--return {name}: name {name!r} is not defined on rank {self.rank}"
                )
            returned[name] = _dumps(self.namespace[name])
        return execute_value(_dumps(last), returned)

    def _call(self, command: Call) -> bytes:
        function, args, kwargs = cloudpickle.loads(command.payload)
        return _dumps(function(*args, **kwargs))

    def _push(self, command: Push) -> None:
        for name, value in cloudpickle.loads(command.names).items():
            self.namespace[name] = value
            self.injected.pop(name, None)  # pushed names are the rank's own from now on

    def _pull(self, command: Pull) -> bytes:
        if command.name not in self.namespace:
            raise NameError(f"name {command.name!r} is not defined on rank {self.rank}")
        return _dumps(self.namespace[command.name])

    def _debug(self, seq: int) -> tuple[str, str]:
        """("done", pdb's last output), or ("nothing", why there is nothing to debug)."""
        failure, commands = self.last_failure, self._commands
        if failure is None or commands is None:
            why = (
                f"the last cell it ran ({self.last_ran}) did not fail there"
                if self.last_ran is not None
                else "no cell has run there yet"
            )
            return "nothing", (
                f"rank {self.rank} has no error to debug: {why}. A rank keeps its error for "
                "%distributed debug until the next cell runs."
            )
        return "done", post_mortem(
            failure,
            self.rank,
            seq,
            lambda: self._receive_for_pdb(commands),
            send,
            self._waiting.append,
            self.cell_files,
        )

    def _receive_for_pdb(self, commands: Connection) -> Any:
        """The kernel's next message while pdb waits for a line. A stop press meanwhile is
        not raised into pdb: the kernel answers it with pdb's "q"."""
        nothing = message = object()
        while message is nothing:
            with contextlib.suppress(KeyboardInterrupt), self.interrupts.whole_messages():
                message = commands.recv()
        return message

    def _inject(self, names: dict[str, Any]) -> None:
        for name, value in names.items():
            self.namespace[name] = value
            self.injected[name] = value

    def _owned(self) -> tuple[str, ...]:
        """Names the rank's code bound (or that were pushed): notebook values never replace them."""
        owned = []
        for name, value in self.namespace.items():
            if name.startswith("__") or name in BASE_NAMES:
                continue
            if name in self.injected and self.injected[name] is value:
                continue
            self.injected.pop(name, None)
            owned.append(name)
        return tuple(owned)


def run_cell(code: str, filename: str, namespace: dict[str, Any]) -> Any:
    """Run ``code`` like a notebook cell; return the value of its last expression (or None).

    The source is registered in linecache under ``filename`` so tracebacks show the
    cell's own lines.
    """
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    tree = ast.parse(code, filename, "exec")
    last: ast.expr | None = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body.pop().value  # type: ignore[attr-defined]
    body: CodeType = compile(tree, filename, "exec")
    exec(body, namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last), filename, "eval"), namespace)


def _what(command: Command) -> str:
    """The command, as a status line names it."""
    if isinstance(command, Execute):
        return cell_label(command.filename)
    if isinstance(command, Call):
        return "a function"
    if isinstance(command, Regroup):
        return "a rebuild of the process group"
    return f"a {type(command).__name__.lower()}"


def send(message: FromRank) -> None:
    """Over the launcher's rank -> kernel channel, which carries any picklable message;
    written whole, even when the kernel's interrupt comes meanwhile."""
    with SignalWatch.whole_messages_of_this_process():
        rank_runner.send(message)  # type: ignore[arg-type]


def _dumps(value: Any) -> bytes:
    try:
        # Tensors come back on the CPU, as a launch's results do: rebuilt on a GPU in the
        # kernel, they would initialise CUDA there.
        return rank_runner.dump_result(value, keep_devices=False)
    except Exception:
        return cloudpickle.dumps(RemoteRepr(_safe_repr(value)))


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as error:
        return f"<{type(value).__name__} (repr failed: {error})>"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
