"""A backend of one's own: registered from outside the package, with an option of its
own, and launched through for real; the core names none of it."""

from __future__ import annotations

import os
import select
import textwrap
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
    ) -> list[RankControl]:
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
        return controls


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
