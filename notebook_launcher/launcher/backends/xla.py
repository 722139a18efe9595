"""TPU ranks through torch_xla's own multiprocessing.

The kernel forks one supervisor process, which prepares the environment as torch_xla's
own Kaggle notebook does (dropping ``TPU_PROCESS_ADDRESSES`` and ``CLOUD_TPU_TASK_ID``,
which a single-process runtime presets) and calls ``xmp.spawn(fn, nprocs=None or 1,
start_method="fork")``. torch_xla then forks one process per chip and sets up its runtime
there; nothing of that is re-implemented here. Every rank inherits all ranks' pipes
through the forks, keeps its own (chosen by its process index) and closes the others, then
runs the launcher's rank code, which reports its pid first, so the kernel watches ranks
it did not start. Chips of TPU v2/v3 hold two XLA devices, which torch_xla runs as two
threads of one process: the rank is the process, its first replica reports the value,
and a failure of either fails the rank.

torch_xla returns nothing from its processes: values, failures and output travel through
the launcher's own pipes. Its runtime can start only once per process, so the launch is
refused up front when something already started it in the kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import cloudpickle

from notebook_launcher import hardware
from notebook_launcher import tpu as tpu_module
from notebook_launcher.errors import LaunchConfigError, LaunchUnsupportedError
from notebook_launcher.launcher import rank as rank_module
from notebook_launcher.launcher.backends.base import (
    Backend,
    Ended,
    RankControl,
    RankEnds,
    RankTarget,
    Started,
)
from notebook_launcher.launcher.channel import Failure

if TYPE_CHECKING:
    from notebook_launcher.launcher.plan_types import LaunchPlan
    from notebook_launcher.launcher.rank import RankSpec

# Preset by single-process TPU runtimes (Kaggle); torch_xla only fills them in when unset,
# so left in place they give every forked process the one-process topology.
PRESET_TOPOLOGY = ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID")
_EXIT_CODE_WAIT_S = 2.0  # a rank's process is gone: how long to wait for its exit code
_POLL_S = 0.02


def kernel_runtime_blocker() -> str | None:
    """What started torch_xla's runtime in this process, or None when it is not running."""
    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is None:
        return None
    try:
        running = bool(torch_xla._XLAC._xla_runtime_is_initialized())
    except Exception:  # an unknown torch_xla build: let torch_xla itself judge
        return None
    if not running:
        return None
    core = sys.modules.get("notebook_launcher.accelerator.xla")
    who = getattr(core, "started_outside_launch", None)
    return who or (
        "a cell that used an XLA device (torch_xla.device(), xm.xla_device(), a tensor or "
        "model moved to 'xla', or xr.world_size() / xr.global_ordinal())"
    )


class XlaBackend(Backend):
    name = "xla"
    accelerators = ("tpu",)
    description = "TPU cores (torch_xla)"
    chosen_by_auto_for = ("tpu",)
    # Its ranks are processes of this machine, each known by the pid it reports.
    supports_sessions = True

    def check(self, plan: LaunchPlan) -> None:
        if importlib.util.find_spec("torch_xla") is None:
            raise LaunchUnsupportedError(
                "this machine has a TPU but torch_xla is not installed, and ranks reach TPU "
                "cores only through it. Install the torch_xla release that matches your torch "
                "exactly (pip install 'torch_xla[tpu]==<your torch version>'), restart the "
                "kernel, and launch again; or pass hardware='cpu' to run CPU ranks."
            )
        hosts, why = _slice_hosts()
        if hosts > 1:
            tpu = hardware.detect().tpu
            kind = (
                f"TPU {tpu.accelerator_type} slice" if tpu and tpu.accelerator_type else "TPU slice"
            )
            raise LaunchUnsupportedError(
                f"this machine is one of {hosts} hosts of a {kind} ({why}), "
                "and torch_xla's runtime waits until the processes of every host have joined; a "
                "launch from this notebook starts only this host's. Run the training as a script "
                "on every host at once (gcloud ... tpu-vm ssh --worker=all), or use a single-host "
                "TPU (v5e-8, v4-8, v3-8, v2-8)."
            )
        who = kernel_runtime_blocker()
        if who is not None:
            raise LaunchConfigError(
                f"torch_xla's runtime is already running in this kernel: {who} started it. "
                "torch_xla starts its runtime once per process, and ranks forked from this "
                "kernel would each fail with 'Runtime is already initialized'. Restart the "
                "kernel, then use XLA devices (torch_xla.device(), Accelerator()) only inside "
                "the launched function."
            )
        if plan.start.method != "fork":
            why = plan.start.fallback_reason or f"start_method={plan.start.method!r} was asked for"
            raise LaunchConfigError(
                f"TPU ranks are forked from this kernel by torch_xla (start method 'fork', which "
                f"functions defined in a notebook cell need), but {why}. Pass "
                "start_method='fork' (or leave it unset)."
            )

    def start(
        self,
        plan: LaunchPlan,
        specs: Sequence[RankSpec],
        ends: Sequence[RankEnds],
        payload: Any,
        target: RankTarget,
    ) -> Started:
        # All of this host's processes: torch_xla's own default (nprocs=None), a pool with
        # one process per chip, even when that is one. Fewer (only 1 is possible): torch_xla
        # runs the function in the supervisor itself (nprocs=1).
        tpu = hardware.detect().tpu
        nprocs = None if len(specs) == (tpu.processes if tpu is not None else 1) else 1
        supervisor = _Supervisor.start(nprocs, specs, ends, payload, target)
        return _XlaStarted([XlaRankControl(supervisor) for _ in specs], supervisor)


class _XlaStarted(Started):
    """One launch's ranks and the supervisor process that forked them."""

    def __init__(self, controls: list[RankControl], supervisor: _Supervisor) -> None:
        super().__init__(controls)
        self.supervisor = supervisor

    def close(self) -> None:
        self.supervisor.close()


def _slice_hosts() -> tuple[int, str]:
    """Hosts of this machine's TPU slice, from every source torch_xla reads them from."""
    tpu = hardware.detect().tpu
    if tpu is None or tpu.pjrt_device != "TPU":
        return 1, ""
    hosts, why = tpu_module.slice_hosts(os.environ)
    if hosts <= 1 and not os.environ.get("TPU_SKIP_MDS_QUERY"):
        # torch_xla then asks the VM's metadata for the slice's workers: so do we.
        workers = tpu_module.metadata_worker_count()
        if workers is not None and workers > 1:
            return workers, f"the VM's metadata lists {workers} workers"
    return hosts, why


class _Supervisor:
    """The kernel's handle on the process that runs ``xmp.spawn``."""

    def __init__(self, process: Any, status: Connection) -> None:
        self.process = process
        self.pid: int = process.pid
        self._status = status
        self.exit_codes: dict[int, int | None] = {}  # rank pid -> exit code, once it reported

    @classmethod
    def start(
        cls,
        nprocs: int | None,
        specs: Sequence[RankSpec],
        ends: Sequence[RankEnds],
        payload: Any,
        target: RankTarget,
    ) -> _Supervisor:
        context = multiprocessing.get_context("fork")
        status_r, status_w = context.Pipe(duplex=False)
        process = context.Process(
            target=_supervise,
            args=(nprocs, list(specs), list(ends), payload, target, status_w),
            name="notebook_launcher-xla-supervisor",
        )
        try:
            process.start()
        except BaseException:
            status_r.close()
            raise
        finally:
            status_w.close()
        assert process.pid is not None  # started
        with contextlib.suppress(OSError):  # races the supervisor's own setpgid
            os.setpgid(process.pid, process.pid)
        return cls(process, status_r)

    @property
    def ended(self) -> bool:
        return self.process.exitcode is not None

    def read_status(self) -> None:
        with contextlib.suppress(EOFError, OSError):
            while not self._status.closed and self._status.poll():
                self.exit_codes.update(self._status.recv())

    def signal(self, signum: int) -> None:
        """The supervisor and the ranks that have not left its process group yet."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)
            return
        if self.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signum)

    def close(self, grace_s: float = 3.0) -> None:
        if self._status.closed:  # closed already
            return
        if self.process.exitcode is None:
            self.signal(signal.SIGTERM)
            self.process.join(grace_s)
        if self.process.exitcode is None:
            self.signal(signal.SIGKILL)
            self.process.join()
        self.signal(signal.SIGKILL)  # what is left in its group
        self._status.close()
        self.process.close()


class XlaRankControl(RankControl):
    """A rank forked by torch_xla: known by the pid it reports, watched through /proc or a pidfd."""

    def __init__(self, supervisor: _Supervisor) -> None:
        self._supervisor = supervisor
        self._pidfd: int | None = None
        self._gone_at: float | None = None
        self._signalled = False  # the launcher asked it to end

    def pid_reported(self, pid: int) -> None:
        super().pid_reported(pid)
        if pid != self._supervisor.pid and hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(pid)

    def poll(self) -> Ended | None:
        supervisor = self._supervisor
        if self.pid is None or self.pid == supervisor.pid:
            # Not started yet (ended with the supervisor if it never does), or it is the supervisor.
            code = supervisor.process.exitcode
            return None if code is None else Ended(code if self.pid is not None else None)
        if not self._gone():
            return None
        supervisor.read_status()
        now = time.monotonic()
        self._gone_at = self._gone_at or now
        waited = now - self._gone_at > _EXIT_CODE_WAIT_S
        if self.pid in supervisor.exit_codes:
            code = supervisor.exit_codes[self.pid]
            if (
                code == -signal.SIGTERM
                and not self._signalled
                and not (supervisor.ended and waited)
            ):
                # torch_xla's pool ends the other ranks with SIGTERM once one of them ended;
                # held back, the launcher sees the rank that caused it first and stops these.
                return None
            return Ended(code)
        if supervisor.ended or waited:
            return Ended(None)  # torch_xla's pool reaped it and nobody can tell its code
        return None

    def signal(self, signum: int) -> None:
        self._signalled = True
        if self.pid is None or self.pid == self._supervisor.pid:
            self._supervisor.signal(signum)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)  # the rank leads its own group once it runs
            return
        if not self._gone():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signum)

    def wait(self, timeout: float) -> Ended | None:
        deadline = time.monotonic() + timeout
        while True:
            ended = self.poll()
            if ended is not None or time.monotonic() >= deadline:
                return ended
            time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    def release(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _gone(self) -> bool:
        """The rank's process ended (a zombie counts: it runs no more)."""
        if self._pidfd is not None:
            import select

            # poll, not select: in a kernel holding a thousand descriptors the pidfd's
            # number is past what select() takes.
            watched = select.poll()
            watched.register(self._pidfd, select.POLLIN)
            return bool(watched.poll(0))
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as stat:
                return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
        except (OSError, IndexError):
            return True


# In the supervisor --------------------------------------------------------------------


def _supervise(
    nprocs: int | None,
    specs: list[RankSpec],
    ends: list[RankEnds],
    payload: Any,
    target: RankTarget,
    status: Connection,
) -> None:
    """Supervisor process: prepare torch_xla's environment, spawn, report the ranks' ends."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # stopping the launch stops the supervisor with what it forked
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_kernel()
    for name in PRESET_TOPOLOGY:
        os.environ.pop(name, None)
    # What torch_xla prints before a rank takes its own pipes shows as rank 0's output.
    os.dup2(ends[0].stdout.fileno(), 1)
    os.dup2(ends[0].stderr.fileno(), 2)
    started = _record_started_processes()
    global _launch
    # Handed over by fork, not through torch_xla's process pool, which pickles what it sends
    # (a function defined in a cell would not pickle; pipes would arrive as copies).
    _launch = _Launch(specs, ends, payload, target, dict(os.environ), os.getpid())
    code = 0
    try:
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(_replica_entry, nprocs=nprocs, start_method="fork")
    except BaseException as error:
        code = 1
        if type(error).__name__ != "BrokenProcessPool":  # else a rank ended and said why
            _report_spawn_failure(ends[0].channel, error)
    finally:
        with contextlib.suppress(Exception):
            status.send({process.pid: process.exitcode for process in started})
        rank_module._flush()
        os._exit(code)


def _die_with_kernel() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(1)


def _record_started_processes() -> list[Any]:
    """The processes torch_xla's pool starts, kept to read their exit codes afterwards."""
    started: list[Any] = []
    base = multiprocessing.process.BaseProcess
    original = base.start

    def start(process: Any) -> None:
        original(process)
        started.append(process)

    base.start = start  # type: ignore[method-assign,assignment]  # this process only
    return started


def _failure(error: BaseException, prefix: str = "") -> Failure:
    qualified = type(error).__qualname__
    if type(error).__module__ not in ("builtins", "__main__"):
        qualified = f"{type(error).__module__}.{qualified}"
    try:
        pickled: bytes | None = cloudpickle.dumps(error)
    except Exception:
        pickled = None
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return Failure(qualified, f"{prefix}{error}", text, time.time(), pickled)


def _report_spawn_failure(channel: Connection, error: BaseException) -> None:
    with contextlib.suppress(Exception):
        channel.send(_failure(error, "torch_xla could not start the ranks: "))


# In each rank (a process torch_xla forked, or the supervisor with one process) -------


@dataclasses.dataclass(frozen=True)
class _Launch:
    specs: list[RankSpec]
    ends: list[RankEnds]
    payload: Any
    target: RankTarget
    supervisor_environ: dict[str, str]  # before torch_xla set each process's topology
    supervisor_pid: int


_launch: _Launch | None = None
_claim_lock = threading.Lock()
_arrived = threading.Condition(_claim_lock)
_started: list[int] = []  # the global ordinals of this process's replicas that started
_claimed: int | None = None  # the process index of the rank this process runs
_rank_taken = False  # a replica of this process runs the rank
_ready = threading.Event()  # the rank's process is set up: its other replicas may run
# A safety net only: torch_xla starts every replica of a process at once.
_REPLICAS_WAIT_S = 300.0


def _replica_entry(ordinal: int) -> None:
    """What torch_xla calls on each replica: the process's lowest ordinal runs the rank
    (whichever replica thread the machine happened to start first)."""
    global _claimed, _rank_taken
    import torch_xla.runtime as xr

    assert _launch is not None, "set by the supervisor before it forked this process"
    specs, ends, payload, target = _launch.specs, _launch.ends, _launch.payload, _launch.target
    supervisor_environ = _launch.supervisor_environ
    index = int(xr.process_index())
    mine = int(xr.global_ordinal())
    replicas = int(xr.addressable_device_count())
    with _arrived:
        _started.append(mine)
        _arrived.notify_all()
        _arrived.wait_for(lambda: len(_started) >= replicas, timeout=_REPLICAS_WAIT_S)
        first = mine == min(_started) and not _rank_taken
        _rank_taken = _rank_taken or first
        if _claimed is None:
            _claimed = index
    if _claimed != index:
        raise RuntimeError(
            f"torch_xla ran the ranks of process indexes {_claimed} and {index} in one process "
            f"(pid {os.getpid()}); each needs a process of its own. Report this with your "
            "torch_xla version."
        )
    if not first:
        _ready.wait()
        _run_extra_replica(payload)
        return
    for other, rank_ends in enumerate(ends):
        if other != index:  # so that this rank's end closes only its own pipes
            rank_ends.close()
    spec = specs[index]
    environ = dict(spec.environ)
    # torch_xla's per-process topology variables, set between the fork and this call.
    environ.update({k: v for k, v in os.environ.items() if supervisor_environ.get(k) != v})
    for name in PRESET_TOPOLOGY:
        if name not in os.environ:
            environ.pop(name, None)
    spec = dataclasses.replace(spec, environ=environ, return_when_done=True)
    if int(xr.addressable_device_count()) > 1:
        payload = (_first_replica, (payload,), {})
    else:
        _ready.set()
    target(spec, payload, ends[index])
    if os.getpid() != _launch.supervisor_pid:
        _end_at_exit_despite_threads()


def _end_at_exit_despite_threads() -> None:
    """A rank in torch_xla's pool ends when the pool lets it go, whatever threads remain.

    The rank returned into torch_xla's pool, whose process, at its normal exit, would
    wait for every non-daemon thread the function left running, and the launch with it.
    Registered now, this runs at that exit after the pool's own clean-up, before the
    wait: the rank ends as ranks of other backends do, with what it started.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # an interpreter without it: the process ends as Python decides
        return

    def end() -> None:
        current = threading.current_thread()
        if any(t is not current and not t.daemon and t.is_alive() for t in threading.enumerate()):
            rank_module._exit(0)

    with contextlib.suppress(RuntimeError):  # the interpreter is shutting down already
        register(end)


def _first_replica(payload: Any) -> Any:
    function, args, kwargs = _unpack(payload)
    if _launch is not None and os.getpid() != _launch.supervisor_pid:  # never the kernel's own
        _add_lazy_variables()
    _ready.set()  # the rank's pipes and environment are in place
    return function(*args, **kwargs)


def _add_lazy_variables() -> None:
    """Add now what torch adds to the environment on first use, while no other replica runs.

    Adding a variable may move the C environment's array (setenv reallocates it), and
    another replica thread reading it meanwhile (a getenv in torch's C++ code) crashed
    with SIGSEGV. Replacing a variable's value never moves the array.
    """
    with contextlib.suppress(Exception):  # a torch without it: nothing to add
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        cache_dir()  # TORCHINDUCTOR_CACHE_DIR, set by the first optimizer step or compile


def _run_extra_replica(payload: Any) -> None:
    """A second device thread of a v2/v3 process: runs the function, its value unused."""
    try:
        function, args, kwargs = _unpack(payload)
        function(*args, **kwargs)
    except BaseException as error:
        with contextlib.suppress(Exception):
            rank_module.send(_failure(error))
        rank_module._flush()
        os._exit(1)


def _unpack(payload: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    function, args, kwargs = cloudpickle.loads(payload) if isinstance(payload, bytes) else payload
    return function, args, kwargs


BACKEND = XlaBackend()
