"""A backend of one's own: registered from outside the package, with an option of its
own, and launched through for real; the core names none of it."""

from __future__ import annotations

import os
import select
import signal
import sys
import textwrap
import threading
import time
import types
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from notebook_launcher import notebook_launcher
from notebook_launcher.cli import _backend_options, build_parser
from notebook_launcher.errors import (
    LaunchConfigError,
    LaunchTypeError,
    LaunchUnsupportedError,
    RankFailedError,
)
from notebook_launcher.launcher import backends
from notebook_launcher.launcher.backends.base import (
    Backend,
    BackendOption,
    Ended,
    RankControl,
    RankEnds,
    RankTarget,
    Started,
)


def _niceness(value: Any) -> int:
    text = str(value).strip()
    if not text.isdigit() or int(text) > 19:
        raise LaunchConfigError(f"toy_niceness must be a whole number from 0 to 19; got {value!r}.")
    return int(text)


class PidfdControl(RankControl):
    """A child forked by os.fork, watched through its pidfd (readable once it ended)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = os.pidfd_open(pid)
        self._ended: Ended | None = None

    @property
    def sentinel(self) -> int | None:
        return self._fd

    def poll(self) -> Ended | None:
        if self._ended is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self._ended = Ended(os.waitstatus_to_exitcode(status))
        return self._ended

    def signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def wait(self, timeout: float) -> Ended | None:
        if self._fd is not None and self.poll() is None:
            select.select([self._fd], [], [], timeout)
        return self.poll()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ToyBackend(Backend):
    """Ranks forked with os.fork itself, each at the niceness the user asked for."""

    name = "toy"
    accelerators = ("cpu",)
    description = "processes forked by os.fork"
    options = (BackendOption("toy_niceness", "how nice the ranks are (0-19)", _niceness, "N"),)

    def start(
        self,
        plan: Any,
        specs: Sequence[Any],
        ends: Sequence[RankEnds],
        payload: Any,
        target: RankTarget,
    ) -> Started:
        controls: list[RankControl] = []
        for spec, rank_ends in zip(specs, ends):
            pid = os.fork()
            if pid == 0:  # the rank: it never returns from here
                try:
                    os.nice(plan.backend_options["toy_niceness"] or 0)
                    target(spec, payload, rank_ends)
                finally:
                    os._exit(70)
            controls.append(PidfdControl(pid))
        return Started(controls)


@pytest.fixture(scope="module")
def toy() -> Iterator[ToyBackend]:
    backend = backends.register(ToyBackend())
    try:
        yield backend
    finally:
        backends.unregister("toy")


def where_and_how_nice(base: int) -> tuple[int, int, int]:
    print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"])
    return int(os.environ["RANK"]), os.nice(0) - base, os.getppid()


def fail_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 gives up")


def test_a_registered_backend_runs_ranks_with_its_own_option(toy, capfd):
    base = os.nice(0)
    values = notebook_launcher(
        where_and_how_nice,
        (base,),
        num_processes=2,
        backend="toy",
        toy_niceness=3,
        return_all=True,
        dashboard=False,
    )
    assert values == [(0, 3, os.getpid()), (1, 3, os.getpid())]
    out = capfd.readouterr().out
    assert "rank 0 of 2" in out and "rank 1 of 2" in out
    with pytest.raises(RankFailedError, match=r"rank 1") as caught:
        notebook_launcher(
            fail_on_rank_1, num_processes=2, backend="toy", dashboard=False, output="none"
        )
    assert isinstance(caught.value, ValueError) and "rank 1 gives up" in str(caught.value)


def test_a_backends_option_is_checked_by_it_and_refused_elsewhere(toy):
    with pytest.raises(
        LaunchConfigError, match=r"toy_niceness must be a whole number from 0 to 19; got 'high'"
    ):
        notebook_launcher(print, backend="toy", toy_niceness="high")
    with pytest.raises(
        LaunchConfigError,
        match=r"toy_niceness=3 is only used with backend='toy'; pass backend='toy' to run the ranks "
        r"on processes forked by os\.fork, or leave toy_niceness unset\.",
    ):
        notebook_launcher(print, toy_niceness=3)
    with pytest.raises(
        LaunchTypeError,
        match=r"notebook_launcher\(\) got an unexpected keyword argument 'num_proceses': it is "
        r"neither one of its arguments nor an option of a backend\. Did you mean num_processes\? "
        r"The backends' own options are: ray_address \(backend='ray'\); toy_niceness \(backend='toy'\)\.",
    ):
        notebook_launcher(print, num_proceses=2)
    with pytest.raises(
        LaunchConfigError,
        match=r"backend='nope' is not known; use one of 'auto', 'local', 'xla', 'ray', 'toy'",
    ):
        notebook_launcher(print, backend="nope")


def test_names_that_could_not_be_used_are_refused_at_registration(toy):
    class Other(ToyBackend):
        pass

    with pytest.raises(
        LaunchConfigError,
        match=r"a backend named 'toy' is registered already \(ToyBackend\); choose another name",
    ):
        backends.register(Other())

    class Auto(ToyBackend):
        name = "auto"

    with pytest.raises(
        LaunchConfigError, match=r"a backend's name must be a lowercase word other than 'auto'"
    ):
        backends.register(Auto())

    class Dashed(ToyBackend):
        name = "dashed"
        options = (BackendOption("toy-niceness", "dashes"),)

    with pytest.raises(
        LaunchConfigError,
        match=r"the 'dashed' backend's option 'toy-niceness' is not a Python identifier",
    ):
        backends.register(Dashed())
    assert "dashed" not in backends.names()


def test_the_command_line_offers_the_backend_and_its_option(toy):
    arguments = build_parser().parse_args(
        ["run", "train.py", "--backend", "toy", "--toy-niceness", "2"]
    )
    assert arguments.backend == "toy" and _backend_options(arguments) == {"toy_niceness": "2"}
    assert "with --backend toy: how nice the ranks are (0-19)" in " ".join(
        build_parser()._subparsers._group_actions[0].choices["run"].format_help().split()  # type: ignore[union-attr]
    )


def test_an_installed_package_adds_a_backend_through_its_entry_point(tmp_path, monkeypatch):
    (tmp_path / "toy_backend_pkg.py").write_text(
        textwrap.dedent("""
        from notebook_launcher.launcher.backends.local import LocalBackend

        class Forks(LocalBackend):
            name = "forks"
            description = "forked processes, packaged"
    """)
    )
    dist = tmp_path / "toy_backend_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-backend-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[notebook_launcher.backends]\nforks = toy_backend_pkg:Forks\nbroken = toy_backend_pkg:Missing\n"
    )
    # A fresh registry, as in a new kernel, that finds the package on sys.path.
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(backends, "_backends", {})
    monkeypatch.setattr(backends, "_unavailable", {})
    monkeypatch.setattr(backends, "_loaded", False)
    assert backends.names() == ("auto", "local", "xla", "ray", "forks", "broken")
    assert backends.lookup("forks").description == "forked processes, packaged"
    with pytest.raises(
        LaunchUnsupportedError,
        match=r"the backend 'broken' that the package 'toy-backend-pkg' adds \(entry point "
        r"'toy_backend_pkg:Missing'\) could not be loaded: AttributeError: .*Missing.*\. Reinstall "
        r"that package, or pass another backend\.",
    ):
        notebook_launcher(print, backend="broken")


# One backend, launches side by side --------------------------------------------------


def _wait_for(path: str, limit_s: float = 120.0) -> None:
    """In a rank: wait until ``path`` exists (the limit is only a safety net)."""
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never came")
        time.sleep(0.01)


def _first_launch(folder: str) -> int:
    open(os.path.join(folder, f"first-started-{os.environ['RANK']}"), "w").close()
    _wait_for(os.path.join(folder, f"second-started-{os.environ['RANK']}"))
    return os.getpid()


def _second_launch(folder: str) -> int:
    open(os.path.join(folder, f"second-started-{os.environ['RANK']}"), "w").close()
    _wait_for(os.path.join(folder, "first-returned"))
    return os.getpid()


@pytest.fixture(params=["local", "xla"])
def one_backend(request, monkeypatch):
    """The backend under test, with what it needs: the xla one on a faked TPU machine."""
    if request.param == "local":
        yield {"backend": "local", "hardware": "cpu", "num_processes": 2}
        return
    from tests.support.tpu import faked_tpu

    with faked_tpu(monkeypatch, "tpu-vm-v4-8"):
        yield {"backend": "xla"}


def test_two_launches_on_one_backend_overlap_without_touching_each_other(
    one_backend, tmp_path, leak_check
):
    """The second launch starts while the first runs, and goes on after the first closed:
    closing the first ends only what the first started (a backend that kept its launch's
    state on itself closed the second's supervisor with the first, and never its own)."""
    folder = str(tmp_path)
    first: dict[str, Any] = {}

    def run_first() -> None:
        try:
            first["values"] = notebook_launcher(
                _first_launch, (folder,), return_all=True, output="none", **one_backend
            )
        except BaseException as error:  # reported by the assertion below
            first["error"] = error
        finally:
            open(os.path.join(folder, "first-returned"), "w").close()

    thread = threading.Thread(target=run_first)
    thread.start()
    try:
        _wait_for(os.path.join(folder, "first-started-0"))
        second = notebook_launcher(
            _second_launch, (folder,), return_all=True, output="none", **one_backend
        )
    finally:
        open(os.path.join(folder, "first-returned"), "w").close()
        for rank in range(16):  # lets the first launch end if the second never started
            open(os.path.join(folder, f"second-started-{rank}"), "w").close()
        thread.join(timeout=300)
    assert not thread.is_alive()
    assert "error" not in first, f"the first launch failed: {first.get('error')!r}"
    assert len(first["values"]) == len(second) >= 2
    assert not set(first["values"]) & set(second)  # each launch had ranks of its own


# Signals to one rank ---------------------------------------------------------------------


def _child_and_wait(folder: str) -> str:
    """A rank that starts a child in its own process group and waits for SIGUSR1."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    got = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: got.set())
    open(os.path.join(folder, f"ready-{os.environ['RANK']}"), "w").close()
    got.wait(120)
    alive = child.poll() is None
    child.kill()
    return f"signalled={got.is_set()} child_alive={alive}"


def test_signal_rank_reaches_the_rank_alone_not_what_it_started(tmp_path, leak_check):
    import uuid

    from notebook_launcher.launcher.rank_group import RankGroup
    from notebook_launcher.launcher.run import rank_specs

    from .test_rank_group import PLAN

    folder = str(tmp_path)
    launch_id = uuid.uuid4().hex[:12]
    group = RankGroup(
        PLAN,
        backends.lookup("local"),
        rank_specs(PLAN, launch_id, 1),
        lambda event: None,
        launch_id=launch_id,
    )
    try:
        group.start((_child_and_wait, (folder,), {}))
        group.run(until=lambda: all(os.path.exists(f"{folder}/ready-{r}") for r in (0, 1)))
        group.signal_rank(1, signal.SIGUSR1)
        group.run(until=lambda: 1 in group.outcome.results)
        assert 0 not in group.outcome.results  # rank 0 was not signalled
        group.signal_rank(0, signal.SIGUSR1)
        outcome = group.run()
    finally:
        group.close()
    values = {rank: result.value() for rank, result in outcome.results.items()}
    assert values == {r: "signalled=True child_alive=True" for r in (0, 1)}


def test_only_backends_whose_ranks_take_commands_and_one_signal_carry_sessions():
    assert backends.lookup("local").supports_sessions
    assert not Backend.supports_sessions  # a backend says so itself


# Loading the registry ----------------------------------------------------------------------


def test_a_thread_that_asks_while_another_loads_the_registry_sees_every_backend(
    tmp_path, monkeypatch
):
    """The registry counts as loaded once it is: a second thread waits for the first
    thread's load instead of seeing a registry loaded only in part."""
    events = types.ModuleType("_registry_load_events")
    events.inside, events.go_on = threading.Event(), threading.Event()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "_registry_load_events", events)
    (tmp_path / "slow_backend_module.py").write_text(
        textwrap.dedent(
            """
            import _registry_load_events as events
            from notebook_launcher.launcher.backends.local import LocalBackend

            events.inside.set()
            events.go_on.wait(60)

            class SlowToImport(LocalBackend):
                name = "slowtoimport"

            BACKEND = SlowToImport()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        backends, "BUILT_IN", (("slowtoimport", "slow_backend_module"), *backends.BUILT_IN)
    )
    monkeypatch.setattr(backends, "_backends", {})
    monkeypatch.setattr(backends, "_unavailable", {})
    monkeypatch.setattr(backends, "_loaded", False)
    seen: dict[str, tuple[str, ...]] = {}
    first = threading.Thread(target=lambda: seen.setdefault("first", backends.names()))
    first.start()
    assert events.inside.wait(60)
    second = threading.Thread(target=lambda: seen.setdefault("second", backends.names()))
    second.start()
    second.join(timeout=0.5)  # a second thread that does not wait returns here at once
    answered_early = "second" in seen
    events.go_on.set()
    first.join(timeout=60)
    second.join(timeout=60)
    assert not answered_early, f"answered while the registry loaded: {seen['second']}"
    assert seen["first"] == seen["second"]
    assert {"slowtoimport", "local", "xla", "ray"} <= set(seen["second"])
