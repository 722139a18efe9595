"""The rank group on its own, with backends that fake what we cannot provoke for real:
a rank stuck in the operating system, ranks that are threads (as Ray actors feed the
kernel), ranks that answer commands (as a session's ranks do)."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import pytest

from notebook_launcher.defaults import EffectiveDefaults, LaunchDefaults
from notebook_launcher.errors import LaunchCleanupWarning
from notebook_launcher.hardware import HardwareReport
from notebook_launcher.launcher.backends.base import (
    Backend,
    Ended,
    RankControl,
    RankEnds,
    Started,
)
from notebook_launcher.launcher.channel import Hello, Result
from notebook_launcher.launcher.events import OutputLine, RankFinished, RankStarted
from notebook_launcher.launcher.plan import LaunchCall, resolve_plan
from notebook_launcher.launcher.rank_group import RankGroup, RankState
from notebook_launcher.launcher.run import rank_specs
from notebook_launcher.launcher.start_method import KernelState

CPU = HardwareReport(
    cpu_count=2,
    gpus=(),
    driver_version=None,
    tpu_cores=0,
    mps_available=False,
    platform="local",
    python_version="3.11",
    torch_version="2.13.0",
    torch_xla_version=None,
)
PLAN = resolve_plan(
    LaunchCall(num_processes=2, monitor_interval=0.01),
    EffectiveDefaults(LaunchDefaults(), {}, None),  # type: ignore[arg-type]
    CPU,
    KernelState(),
)


class StuckControl(RankControl):
    """A rank in uninterruptible sleep: no signal ends it."""

    def __init__(self) -> None:
        self.pid = 2**22 + 1  # not a pid of this machine's
        self.signals: list[int] = []

    def poll(self) -> Ended | None:
        return None

    def signal(self, signum: int) -> None:
        self.signals.append(signum)

    def wait(self, timeout: float) -> Ended | None:
        return None


class FakeBackend(Backend):
    name = "fake"
    accelerators = ("cpu",)

    def __init__(self, make: Any) -> None:
        self.make = make
        self.closed = False

    def start(self, plan, specs, ends, payload, target):  # type: ignore[no-untyped-def]
        return [self.make(spec, rank_ends) for spec, rank_ends in zip(specs, ends)]

    def close(self) -> None:
        self.closed = True


@contextmanager
def descriptors_opened_here() -> Iterator[list[tuple[int, int]]]:
    """The pipes and duplicates this thread opens inside the block, as (fd, inode).

    Only they are checked afterwards: other threads of the test process (pytest-xdist's
    own, a kernel client an earlier test left) open and close descriptors at any moment,
    and a check of the whole process's set would count theirs.
    """
    opened: list[tuple[int, int]] = []
    me = threading.get_ident()
    real_pipe, real_dup = os.pipe, os.dup

    def note(*fds: int) -> None:
        if threading.get_ident() == me:
            opened.extend((fd, os.fstat(fd).st_ino) for fd in fds)

    def pipe() -> tuple[int, int]:
        ends = real_pipe()
        note(*ends)
        return ends

    def dup(fd: int) -> int:
        copy = real_dup(fd)
        note(copy)
        return copy

    os.pipe, os.dup = pipe, dup  # type: ignore[assignment]
    try:
        yield opened
    finally:
        os.pipe, os.dup = real_pipe, real_dup  # type: ignore[assignment]


def still_open(opened: list[tuple[int, int]]) -> list[int]:
    """Those of ``opened`` that still name the same file (a closed number may be reused)."""
    left = []
    for fd, inode in opened:
        try:
            if os.fstat(fd).st_ino == inode:
                left.append(fd)
        except OSError:
            pass
    return left


def test_a_rank_that_will_not_die_is_reported_not_waited_for() -> None:
    with descriptors_opened_here() as opened:
        backend = _close_a_group_of_stuck_ranks()
    assert opened and still_open(opened) == []  # every pipe of the group is closed
    assert backend.closed


def _close_a_group_of_stuck_ranks() -> FakeBackend:
    controls: list[StuckControl] = []
    backend = FakeBackend(lambda spec, ends: controls.append(StuckControl()) or controls[-1])
    events: list[Any] = []
    group = RankGroup(
        PLAN,
        backend,
        rank_specs(PLAN, "stuck", 1),
        events.append,
        launch_id=uuid.uuid4().hex,
        grace_s=0.01,
        kill_wait_s=0.01,
    )
    group.start(payload=None)
    assert [r.state for r in group.ranks] == [RankState.RUNNING, RankState.RUNNING]
    with pytest.warns(LaunchCleanupWarning) as caught:
        stuck = group.close()
    assert [r.rank for r in stuck] == [0, 1]
    assert str(caught[0].message).startswith(
        f"rank 0 (pid {2**22 + 1}), rank 1 (pid {2**22 + 1}) did not end within 0.01s of SIGKILL"
    )
    assert all(c.signals[:2] == [signal.SIGTERM, signal.SIGKILL] for c in controls)
    assert group.close() == stuck  # idempotent
    return backend


class ThreadRank(RankControl):
    """A rank that is a thread feeding duplicates of its ends, as a remote rank's feeder
    thread would; it answers each command on the channel, and ends on "stop"."""

    def __init__(self, rank: int, ends: RankEnds) -> None:
        self.pid = None
        self._rank = rank
        dup = lambda c: Connection(os.dup(c.fileno()), readable=c.readable, writable=c.writable)  # noqa: E731
        self._out, self._channel, self._commands = (
            dup(ends.stdout),
            dup(ends.channel),
            dup(ends.commands),
        )
        self._thread = threading.Thread(target=self._serve)
        self._thread.start()

    def _serve(self) -> None:
        self._channel.send(Hello(4000 + self._rank))  # how a rank forked elsewhere tells its pid
        while True:
            command = self._commands.recv()
            if command == "stop":
                self._channel.send(Result(cloudpickle.dumps(None)))
                break
            os.write(self._out.fileno(), f"rank {self._rank} ran {command}\n".encode())
            self._channel.send(("answer", command))
        for end in (self._out, self._channel, self._commands):
            end.close()

    def poll(self) -> Ended | None:
        return None if self._thread.is_alive() else Ended(0)

    def signal(self, signum: int) -> None:
        pass

    def wait(self, timeout: float) -> Ended | None:
        self._thread.join(timeout)
        return self.poll()


def test_a_group_is_driven_command_by_command_and_watched_between() -> None:
    with descriptors_opened_here() as opened:
        _drive_a_group_command_by_command()
    # the group's pipes and the thread ranks' duplicates of their ends
    assert opened and still_open(opened) == []


def _drive_a_group_command_by_command() -> None:
    events: list[Any] = []
    group = RankGroup(
        PLAN,
        FakeBackend(lambda spec, ends: ThreadRank(spec.rank, ends)),
        rank_specs(PLAN, "session", 1),
        events.append,
        launch_id=uuid.uuid4().hex,
        with_commands=True,
    )
    group.start(payload=None)
    assert [e for e in events if isinstance(e, RankStarted)] == [
        RankStarted(0, None, "cpu"),
        RankStarted(1, None, "cpu"),
    ]
    answers: dict[int, list[Any]] = {0: [], 1: []}

    def on_message(rank, message):  # type: ignore[no-untyped-def]
        answers[rank.rank].append(message[1])

    for k in range(3):
        for rank in range(2):
            group.send(rank, k)
        group.run(
            until=lambda k=k: all(len(a) == k + 1 for a in answers.values()), on_message=on_message
        )
        assert all(r.alive for r in group.ranks)  # still running between commands
        group.watch()
    assert answers == {0: [0, 1, 2], 1: [0, 1, 2]}
    assert [r.pid for r in group.ranks] == [4000, 4001]
    for rank in range(2):
        group.send(rank, "stop")
    outcome = group.run()
    assert outcome.failures == [] and sorted(outcome.results) == [0, 1]
    lines = sorted(e.text for e in events if isinstance(e, OutputLine))
    assert lines == [f"rank {r} ran {k}" for r in range(2) for k in range(3)]
    assert [e.state for e in events if isinstance(e, RankFinished)] == ["done", "done"]
    assert group.close() == []


class ReapedBeforeItsSentinelIsSeen(RankControl):
    """A local rank whose end the group learns by polling before its sentinel fires."""

    def __init__(self, inner: RankControl) -> None:
        self.inner, self.pid = inner, inner.pid

    @property
    def sentinel(self) -> int | None:
        return self.inner.sentinel

    def poll(self) -> Ended | None:
        return self.inner.wait(60.0)

    def signal(self, signum: int) -> None:
        self.inner.signal(signum)

    def wait(self, timeout: float) -> Ended | None:
        return self.inner.wait(timeout)

    def release(self) -> None:
        self.inner.release()


def test_a_finished_group_stops_multiplexing_at_once(leak_check):
    """Once every rank ended and its pipes closed, nothing stays registered: an exit
    sentinel left behind kept select() returning at once, spinning for a second."""
    from notebook_launcher.launcher.backends.local import LocalBackend

    class Local(LocalBackend):
        def start(self, *args):  # type: ignore[no-untyped-def]
            return Started(
                [ReapedBeforeItsSentinelIsSeen(c) for c in super().start(*args).controls]
            )

    group = RankGroup(
        PLAN,
        Local(),
        rank_specs(PLAN, uuid.uuid4().hex, 1),
        lambda event: None,
        launch_id=uuid.uuid4().hex,
    )
    passes = 0
    watch = group.watch

    def counted(timeout: float = 0.0) -> None:
        nonlocal passes
        passes += 1
        watch(timeout)

    group.watch = counted  # type: ignore[method-assign]
    try:
        group.start((print, ("hello",), {}))
        outcome = group.run()
        assert outcome.failures == [] and sorted(outcome.results) == [0, 1]
        assert group._selector is not None and not group._selector.get_map()
        assert passes < 200, f"{passes} passes of the multiplexer for two ranks that print one line"
    finally:
        group.close()
