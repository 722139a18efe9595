"""What runs inside a rank process, whatever started it (fork, forkserver or spawn).

Kept light to import: the forkserver preloads it together with torch.
"""

from __future__ import annotations

import _thread
import builtins
import contextlib
import dataclasses
import faulthandler
import io
import os
import random
import signal
import stat
import sys
import threading
import time
import traceback
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

import cloudpickle

from notebook_launcher import rank_env, rank_memory
from notebook_launcher.descendants import KILL_WAIT_S, end_descendants
from notebook_launcher.errors import RankInputError
from notebook_launcher.launcher.channel import (
    Failure,
    Hello,
    Memory,
    Outbox,
    Progress,
    RankMessage,
    Result,
    Steps,
)
from notebook_launcher.launcher.kept_groups import (
    keep_destroyed_groups,
    stop_keeping_destroyed_groups,
)
from notebook_launcher.launcher.metric_batch import numbers_of, step_of
from notebook_launcher.launcher.signal_wake import SignalWake
from notebook_launcher.launcher.store import SECRET_ENV, protect_env_rendezvous
from notebook_launcher.launcher.whereabouts import Answerer
from notebook_launcher.tracking import (
    add_metric_flush,
    add_metric_sink,
    add_progress_sink,
    add_steps_sink,
    finish_steps,
)

_outbox: Outbox | None = None  # this rank's end of the channel
_forked = False  # started by fork: the kernel's __main__ is this process's __main__
MEMORY_REPORT_S = 1.0  # how often a rank's memory is read; sent only when its peak grew
_MEMORY_STEP_BYTES = 1 << 20  # growth below this is not worth a message


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs besides the function itself; pickled for non-fork starts."""

    rank: int  # global rank
    local_rank: int
    environ: dict[str, str]
    cwd: str
    sys_path: list[str]
    accelerator: str
    threads: int | None
    python_random_state: Any  # the kernel's RNG states, so every start method sees the same
    torch_rng_state: bytes | None
    keep_result_devices: bool = False  # False: tensors in the result travel back on the CPU
    # True: return after reporting the result instead of exiting, for ranks that are workers
    # of someone else's process pool (torch_xla's), which must see them finish their task.
    return_when_done: bool = False


@dataclasses.dataclass
class RankEnds:
    """The rank's ends of the pipes the kernel reads (and, for sessions, writes)."""

    stdout: Connection  # write end; becomes the rank's fd 1
    stderr: Connection  # write end; becomes the rank's fd 2
    channel: Connection  # write end of the rank -> kernel messages
    commands: Connection | None = None  # read end of kernel -> rank commands (sessions)
    asks: Connection | None = None  # read end: the kernel asks where the rank is (launches)

    def close(self) -> None:
        for end in (self.stdout, self.stderr, self.channel, self.commands, self.asks):
            if end is not None and not end.closed:
                end.close()


def send(message: RankMessage) -> None:
    """Send a message to the launching kernel; a no-op outside a launched rank."""
    if _outbox is not None:
        _outbox.send(message)


def run_rank(
    spec: RankSpec,
    payload: bytes | tuple[Any, tuple[Any, ...], dict[str, Any]],
    ends: RankEnds,
) -> None:
    """Process target: become a clean rank, run the function, report how it ended."""
    global _outbox, _forked
    outbox = _outbox = Outbox(ends.channel)
    _forked = not isinstance(payload, bytes)
    outbox.send(Hello(os.getpid()))
    if not spec.return_when_done:  # a pool worker of someone else's (torch_xla) needs its pipes
        _close_inherited_descriptors(ends)
    _normal_builtins()
    add_metric_sink(_forward_metric)
    add_metric_flush(_flush_metrics)
    add_progress_sink(_forward_progress)
    add_steps_sink(_forward_steps)
    _detach_from_kernel()
    _redirect_output(ends.stdout, ends.stderr)
    _apply_kernel_state(spec)
    # The store's keys are the launch's alone; not inherited by what the function starts.
    protect_env_rendezvous(os.environ.pop(SECRET_ENV, None))
    memory = _MemoryReporter()
    answerer = None
    if ends.asks is not None:  # the answerer's side thread takes the readings too
        every = (MEMORY_REPORT_S, memory.report)
        answerer = Answerer(ends.asks.fileno(), send, _signal_wake(), every)
    else:
        memory.start_thread()
    exit_code: int | str | None = None
    try:
        function, args, kwargs = (
            cloudpickle.loads(payload) if isinstance(payload, bytes) else payload
        )
        if ends.commands is None and not spec.return_when_done:  # a launch's own rank
            keep_destroyed_groups()
        if answerer is not None:
            answerer.phase = "running"
        value = function(*args, **kwargs)
        if answerer is not None:
            answerer.phase = "returned"
    except SystemExit as exit_request:
        memory.stop()
        if exit_request.code not in (None, 0):
            _report_failure(exit_request)
            _exit(1)
        value, exit_code = None, exit_request.code if exit_request.code is not None else 0
    except BaseException as error:
        memory.stop()
        _report_failure(error)
        _exit(1)
    memory.stop()
    try:
        result = Result(dump_result(value, spec.keep_result_devices), exit_code)
    except Exception as error:
        wrapped = TypeError(
            f"the return value of rank {spec.rank} (a {type(value).__name__}) cannot be pickled "
            f"back to the notebook: {error}. Return plain data (numbers, tensors, dicts, state_dicts)."
        )
        _report_failure(wrapped)
        _exit(1)
    # Sent before the group is released: releasing it closes the connections of peers still
    # in a collective, which fail and make the launch stop this rank, result sent or not.
    outbox.send(result)  # after the metrics still waiting to leave
    stop_keeping_destroyed_groups()
    _release_process_group()
    if spec.return_when_done:
        _flush()
        return
    _exit(0)


class _MemoryReporter:
    """Sends the rank's peak memory when it grew (read once a second), and once at the end.

    The peak starts over when the rank starts, so that a forked rank reports its own and
    not the kernel's. The readings are taken by the rank's side thread (the answerer's), or
    by a thread of their own (:meth:`start_thread`) where it has none. Nothing here waits for
    a thread (neither its start nor its end): on a busy machine a thread may wait
    milliseconds to be scheduled, which a short launch paid in every rank. The lock keeps a
    reading of the thread from following the final one.
    """

    def __init__(self) -> None:
        self._sent_peak = -_MEMORY_STEP_BYTES
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        with contextlib.suppress(Exception):  # a reading is never worth failing a rank for
            rank_memory.reset_peak()

    def start_thread(self) -> None:
        # The first reading comes after a second: a function that returns sooner has only the
        # final one, and a short launch's ranks spend nothing on readings while gloo starts.
        _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        while not self._stopping.wait(MEMORY_REPORT_S):
            self.report()

    def report(self, final: bool = False) -> None:
        """A reading, sent when the peak grew or when ``final``; none after the final one."""
        with self._lock:
            if self._stopping.is_set() and not final:
                return
            try:
                reading = rank_memory.read()
                if final or reading.peak_bytes - self._sent_peak >= _MEMORY_STEP_BYTES:
                    self._sent_peak = reading.peak_bytes
                    send(
                        Memory(
                            reading.kind,
                            reading.peak_bytes,
                            reading.current_bytes,
                            reading.device,
                            reading.rss_bytes,
                        )
                    )
            except Exception:  # the kernel's end gone, or /proc unreadable: nothing to tell
                return

    def stop(self) -> None:
        """The last reading, sent before the result or the failure (with the last steps)."""
        with contextlib.suppress(Exception):  # a summary is never worth failing a rank for
            finish_steps()
        self._stopping.set()
        self.report(final=True)


def dump_result(value: Any, keep_devices: bool) -> bytes:
    """Cloudpickle a return value; tensors on an accelerator travel as CPU tensors unless
    ``keep_devices``: rebuilt on a GPU in the kernel, they would initialise CUDA there."""
    return _dumps(value, to_cpu=not keep_devices)


def _dumps(value: Any, to_cpu: bool = False) -> bytes:
    buffer = io.BytesIO()
    _RankPickler(buffer, to_cpu=to_cpu).dump(value)
    return buffer.getvalue()


class _RankPickler(cloudpickle.Pickler):
    """cloudpickle, plus: classes of the notebook's ``__main__`` go by reference when the
    rank was forked (the kernel has the very same class, so ``except MyError`` and
    ``isinstance`` keep working), and tensors optionally move to the CPU."""

    def __init__(self, file: io.BytesIO, *, to_cpu: bool) -> None:
        super().__init__(file)
        self._to_cpu = to_cpu and "torch" in sys.modules

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) and _forked and _is_main_global(obj):
            return NotImplemented  # pickle's own by-reference save
        if self._to_cpu:
            torch = sys.modules["torch"]
            if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
                moved = obj.detach().cpu()
                if isinstance(obj, torch.nn.Parameter):
                    moved = torch.nn.Parameter(moved, requires_grad=obj.requires_grad)
                return moved.__reduce_ex__(5)
        return super().reducer_override(obj)


def _is_main_global(cls: type) -> bool:
    main = sys.modules.get("__main__")
    return cls.__module__ == "__main__" and getattr(main, cls.__qualname__, None) is cls


def _forward_metric(rank: int, step: Any, values: dict[str, Any]) -> None:
    """What ``Accelerator.log`` records travels to the kernel (for a live plot)."""
    numbers = numbers_of(values)
    if numbers and _outbox is not None:
        _outbox.log(step_of(step), numbers)


def _forward_steps(rank: int, summary: dict[str, Any]) -> None:
    send(Steps(summary))


def _flush_metrics() -> None:
    if _outbox is not None:
        _outbox.flush()


def _forward_progress(rank: int, n: int, total: int | None, description: str) -> None:
    """The training core's tqdm bars travel as numbers (for the dashboard's progress rows)."""
    send(Progress(n, total, description))


def _detach_from_kernel() -> None:
    # A session of its own, as torchrun gives each of its workers. Where the CPU scheduler
    # shares time out by session (Linux's autogroups, on by default outside CPU cgroups),
    # ranks left in the kernel's session shared one session's share among them: on a busy
    # 2-core machine a LoRA step took 1.5-1.9x as long as in the same launch with a session
    # per rank, at the same CPU time a step (benchmarks/bench_finetune.py). The session's
    # new process group lets the launcher stop the rank with everything it started (data
    # loader workers) in one signal, and keeps the kernel's interrupt off the rank.
    try:
        os.setsid()
    except OSError:  # leads a group already (the second rank thread of a TPU v2/v3 process)
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Else a worker thread of torch_xla's: its supervisor set both before forking it.
    _forget_inherited_forkserver()
    _die_with_parent()


def _signal_wake() -> SignalWake | None:
    """The function's signal handlers run while its main thread sleeps (see signal_wake);
    only a rank's main thread can install it (not a thread of torch_xla's)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        return SignalWake()
    except (OSError, ValueError):
        return None


def _close_inherited_descriptors(ends: RankEnds) -> None:
    """Let go of the sockets and event descriptors the rank inherited from the kernel.

    A forked rank holds copies of everything the kernel had open: its listening ZMQ ports
    and their connections, its event loop. Each is replaced by /dev/null rather than
    closed, so a kernel object that later closes "its" descriptor number cannot close
    something the rank opened since. Regular files stay (a file the notebook opened may be
    what the function reads), and so do pipes: multiprocessing learns that the rank ended
    from the end of a pipe the rank holds, whose number the rank cannot know.
    """
    import multiprocessing
    from multiprocessing import resource_tracker

    keep = {0, 1, 2}
    parent_sentinel = getattr(multiprocessing.parent_process(), "_sentinel", None)
    if isinstance(parent_sentinel, int):
        keep.add(parent_sentinel)
    for end in (ends.stdout, ends.stderr, ends.channel, ends.commands, ends.asks):
        if end is not None and not end.closed:
            keep.add(end.fileno())
    tracker_fd = getattr(getattr(resource_tracker, "_resource_tracker", None), "_fd", None)
    if isinstance(tracker_fd, int):
        keep.add(tracker_fd)
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return  # not Linux: nothing to list the descriptors with
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)  # the kernel's event loop's, about to go
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in names:
            fd = int(name)
            if fd in keep or fd == null:
                continue
            # Pipes, terminals and folders stay, a socket goes; only what may be an anonymous
            # inode (no file type, or a pidfd's regular one) has its name read, which costs
            # five times fstat's (a kernel holds a hundred descriptors).
            try:
                kind = stat.S_IFMT(os.fstat(fd).st_mode)
                if kind == stat.S_IFSOCK:
                    target = "socket:"
                elif kind in (0, stat.S_IFREG):
                    target = os.readlink(f"/proc/self/fd/{fd}")
                else:
                    continue
            except OSError:
                continue  # the listing's own descriptor, already closed
            if target.startswith(("socket:", "anon_inode:")):
                with contextlib.suppress(OSError):
                    os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


def _normal_builtins() -> None:
    """The builtins a plain interpreter has: IPython hides ``exit`` and ``quit`` while a
    cell runs (and adds its own names), and a forked rank would keep that state."""
    import _sitebuiltins

    for name, eof in (("exit", "Ctrl-D (i.e. EOF)"), ("quit", "Ctrl-D (i.e. EOF)")):
        if not hasattr(builtins, name):
            setattr(builtins, name, _sitebuiltins.Quitter(name, eof))
    for name in ("get_ipython", "display", "__IPYTHON__"):
        builtins.__dict__.pop(name, None)


def _forget_inherited_forkserver() -> None:
    """Drop the kernel's forkserver "alive" pipe, which a forkserver hands every child.

    While any rank holds it, the forkserver never sees the kernel die and so never exits,
    and ranks (which die with the forkserver) would outlive a killed kernel. A rank that
    needs a forkserver of its own starts a fresh one.
    """
    # forkserver is imported with this module, in the kernel: a forked rank that imported
    # it here paid about a millisecond before its function could start.
    server: Any = forkserver._forkserver
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None and getattr(server, "_forkserver_pid", None) is None:
        with contextlib.suppress(OSError):
            os.close(alive_fd)
        server._forkserver_alive_fd = None
        server._forkserver_address = None


def _loaded_libc() -> Any:
    """The C library's functions, looked up in the process that imports this module (the
    kernel), so that a forked rank finds them ready: looking them up took a forked rank a
    quarter of a millisecond before its function could start."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl  # noqa: B018 (resolved now: ctypes keeps the function on the object)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _loaded_libc()


def _die_with_parent() -> None:
    """If the kernel (or the forkserver) dies, the rank must not outlive it."""
    libc = _LIBC
    if libc is not None:
        pr_set_pdeathsig, pr_set_child_subreaper = 1, 36
        with contextlib.suppress(OSError, AttributeError):
            libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
            # What a rank's daemon leaves orphaned (double fork) is re-parented to the rank,
            # not to init, so the rank still finds it when it ends (see _exit).
            libc.prctl(pr_set_child_subreaper, 1)
    if os.getppid() == 1:  # the parent died before the line above took effect
        os._exit(1)


def _redirect_output(stdout: Connection, stderr: Connection) -> None:
    """Point fds 1 and 2 at the launcher's pipes, so C/C++ output is caught as well, and
    fd 0 at /dev/null: a rank has no terminal or notebook to read from."""
    for connection, fd in ((stdout, 1), (stderr, 2)):
        os.dup2(connection.fileno(), fd)
        connection.close()
    _no_stdin()
    # Replace whatever the kernel installed (ipykernel's streams talk to its own sockets).
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(
            os.fdopen(fd, "wb", closefd=False), line_buffering=True, errors="backslashreplace"
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    # Disabled first: enable() on an already enabled faulthandler keeps its old signal
    # handlers, and a library in the kernel (Ray) may have installed its own over them.
    faulthandler.disable()
    faulthandler.enable(file=sys.stderr, all_threads=False)


def _no_stdin() -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    if null != 0:
        os.dup2(null, 0)
        os.close(null)
    stdin = io.TextIOWrapper(os.fdopen(0, "rb", closefd=False))
    sys.stdin = stdin
    sys.__stdin__ = stdin  # type: ignore[misc]
    # ipykernel's input() asks the notebook frontend, which would wait for an answer
    # the rank can never receive: fail at once instead.
    builtins.input = _no_input
    getpass: Any = sys.modules.get("getpass")
    if getpass is not None:
        getpass.getpass = _no_input


def _no_input(prompt: object = "", *args: Any, **kwargs: Any) -> str:
    shown = f" (prompt {str(prompt)!r})" if prompt else ""
    raise RankInputError(
        f"input(){shown} cannot be used in a rank: ranks have no terminal or notebook to read "
        "from (their stdin is /dev/null). Read the value in the notebook before the launch "
        "and pass it to the function with args= or kwargs=."
    )


def _apply_kernel_state(spec: RankSpec) -> None:
    # Changed in place, never emptied: other threads of this process (a TPU v2/v3 process's
    # second replica, torch_xla's own) may read the environment meanwhile.
    os.environ.update(spec.environ)
    for name in [name for name in os.environ if name not in spec.environ]:
        os.environ.pop(name, None)
    rank_env.accelerate_sees_every_cpu_rank()
    with contextlib.suppress(OSError):
        os.chdir(spec.cwd)
    sys.path[:] = spec.sys_path
    random.setstate(spec.python_random_state)
    torch = sys.modules.get("torch")
    if torch is None and (spec.torch_rng_state is not None or spec.accelerator == "cuda"):
        import torch
    if torch is not None:
        if spec.torch_rng_state is not None:
            torch.random.set_rng_state(
                torch.frombuffer(bytearray(spec.torch_rng_state), dtype=torch.uint8)
            )
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        if spec.accelerator == "cuda":
            torch.cuda.set_device(spec.local_rank)


def _report_failure(error: BaseException) -> None:
    with contextlib.suppress(Exception):
        send(failure_record(error))


# The package's own folder: its frames above the user's code are left out of a rank's traceback.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep


def failure_record(error: BaseException) -> Failure:
    """How ``error`` ended a rank's function (a launch) or command (a session), as the kernel
    receives it: the exception itself and its type pickled each on their own (an instance
    with an attribute that cannot travel still brings its type), and the traceback text from
    the user's code down."""
    error_type = type(error)
    qualified = error_type.__qualname__
    if error_type.__module__ not in ("builtins", "__main__"):
        qualified = f"{error_type.__module__}.{qualified}"
    try:
        pickled: bytes | None = _dumps(error)
    except Exception:  # e.g. an attribute that cannot be pickled: the type still can
        pickled = None
    try:
        pickled_type: bytes | None = _dumps(error_type)
    except Exception:
        pickled_type = None
    text = "".join(traceback.format_exception(error_type, error, user_frames(error.__traceback__)))
    return Failure(qualified, str(error), text, time.time(), pickled, pickled_type)


def user_frames(frames: TracebackType | None) -> TracebackType | None:
    """The traceback from the user's code down: the package's own frames above it (the rank
    runner, a session's command loop) are left out. Where the error came from the package
    alone, its frames are kept: they are then the whole story."""
    first = frames
    while first is not None and first.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        first = first.tb_next
    return frames if first is None else first


# How long a rank that returned keeps its connections open for peers that have not.
_PEERS_RETURN_GRACE_S = 5.0


def _release_process_group() -> None:
    # A group left open makes torch warn at exit and can hold the store's port.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            _wait_for_peers_to_return(dist)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _wait_for_peers_to_return(dist: Any) -> None:
    """Keep this rank's connections open until every rank of the group has returned too
    (a few seconds at most).

    A rank that returns right after joining the group (a function that only builds
    ``PartialState()``) may have finished its side of Gloo's connection handshake while a
    peer is still in its own: closing then fails the peer with "Connection closed by
    peer". Each rank marks its return in the group's store and waits for the others' marks,
    which the last rank to return completes at once. A peer still at work after the grace
    (one that needed this rank in a collective it never joined) fails as it would have.
    """
    from datetime import timedelta

    store = dist.distributed_c10d._get_default_store()
    key = "notebook_launcher/returned/{}"
    store.set(key.format(dist.get_rank()), b"1")
    keys = [key.format(rank) for rank in range(dist.get_world_size())]
    store.wait(keys, timedelta(seconds=_PEERS_RETURN_GRACE_S))


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _exit(code: int) -> None:
    _flush()
    # Nothing a rank started outlives it, even a daemon that left its process group
    # without running a new program (the launch's id in the environment finds those);
    # they have ended before the launch learns that the rank has.
    with contextlib.suppress(Exception):
        end_descendants(wait_s=KILL_WAIT_S)
    os._exit(code)
