from __future__ import annotations

import atexit
import importlib
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from notebook_launcher import hardware, rank_env

# torch's optimizers import torch._dynamo the first time one is built, seconds of CPU in
# every rank; imported once here, the ranks forked from this process start with it.
importlib.import_module("torch._dynamo")

# Launches the tests make register in a private runtime dir: a test that stops "the running
# launch" must never find a launch of the user's (or of another test session). A rank that
# imports this module (to unpickle a test's function) keeps the one it inherited.
if not rank_env.inside_rank():
    os.environ["JUPYTER_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="notebook-launcher-tests-")
    atexit.register(shutil.rmtree, os.environ["JUPYTER_RUNTIME_DIR"], True)


BROWSER_TESTS = Path(__file__).parent / "browser"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Which tests must share a pytest-xdist worker (``--dist loadgroup``, as ``make test``
    runs them): the browser tests (one Jupyter server and one chromium), the Ray tests that
    start clusters of their own (one cluster at a time: each takes a core and over a GB),
    and the tests of a module that share a fixture made once per module (a kernel, a launch,
    a Ray cluster). The rest spread freely.

    Groups come first, Ray's and the browser's leading: ``make test`` has pytest-xdist hand out
    work in collection order (--no-loadscope-reorder), and a long group handed out last
    would run alone at the end while the single tests fill the other workers."""
    order: dict[int, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if BROWSER_TESTS in Path(str(item.fspath)).parents:
            group, rank = "browser", 1
            item.add_marker(pytest.mark.slow(reason=_BROWSER_SLOW))
        elif item.get_closest_marker("ray") is not None:
            # A module's tests that join its one cluster, apart from the tests that start
            # clusters of their own (those one at a time).
            group, rank = (f"ray {module}" if _shares_a_module_fixture(item) else "ray clusters"), 0
        elif _shares_a_module_fixture(item):
            group, rank = module, 2
        else:
            continue
        item.add_marker(pytest.mark.xdist_group(group))
        order[id(item)] = rank
    items.sort(key=lambda item: order.get(id(item), 3))
    unexplained = [
        item.nodeid
        for item in items
        if any(not mark.kwargs.get("reason") for mark in item.iter_markers("slow"))
    ]
    if unexplained:
        raise pytest.UsageError(
            f"mark slow tests with their reason, pytest.mark.slow(reason=...): {unexplained[:5]}"
        )


# The first browser test starts JupyterLab's server and chromium for all of them.
_BROWSER_SLOW = (
    "drives JupyterLab or Notebook 7 in chromium; the first starts the shared server and browser"
)


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        definition.scope in ("module", "class", "package")
        for definitions in info.name2fixturedefs.values()
        for definition in definitions
    )


def rank_processes(pid: int | None = None) -> list[psutil.Process]:
    """Descendants of ``pid`` other than multiprocessing's long-lived helpers.

    The forkserver (kept warm on purpose) and the resource tracker are not ranks; the
    ranks a forkserver forked share its command line but are its children, and count.
    """
    helpers = []
    for child in psutil.Process(pid).children(recursive=False):
        try:
            cmdline = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if "forkserver import main" in cmdline or "resource_tracker" in cmdline:
            helpers.append(child.pid)
    return [p for p in psutil.Process(pid).children(recursive=True) if p.pid not in helpers]


# A process started in the background by a non-interactive shell (`make test &`, a CI
# script's job) inherits SIGINT ignored, and Python then keeps it so: the tests of the stop
# button press it on themselves, as a user presses it in a kernel running a cell.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
_last_test = {"name": "(none yet)"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A test stopped by its safety net gets the stacks of the kernels and ranks below it,
    read while they still hang (pytest-timeout shows the test process's threads only)."""
    outcome = yield
    report = outcome.get_result()
    if (
        report.failed
        and call.excinfo is not None
        and "from pytest-timeout" in str(call.excinfo.value)
    ):
        from tests.support.stacks import descendants_stacks

        report.sections.append(
            ("stacks of the test's processes at its timeout", descendants_stacks())
        )


@pytest.fixture(autouse=True)
def _default_sigint(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts with Python's own SIGINT handler; a test that left another one is
    named in a warning."""
    found = signal.getsignal(signal.SIGINT)
    if (
        found is not signal.default_int_handler
        and threading.current_thread() is threading.main_thread()
    ):
        warnings.warn(
            f"SIGINT's handler was {found!r} after {_last_test['name']}; reset", stacklevel=1
        )
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    _last_test["name"] = request.node.nodeid


@pytest.fixture(scope="session")
def _process_wide_state():
    """Create what lives once per process, so leak checks see only per-launch leftovers.

    torch's libuv TCPStore opens one pipe pair the first time a store starts and keeps it.
    """
    from notebook_launcher.launcher.store import RendezvousStore, bind_listener

    RendezvousStore(bind_listener("127.0.0.1", None), 1).close()


@pytest.fixture
def leak_check(_process_wide_state):
    """Fail the test if a launch left a process, descriptor, thread or env change behind."""
    fds_before = set(os.listdir("/proc/self/fd"))
    threads_before = set(threading.enumerate())
    environ_before = _environ()
    handlers_before = _signal_handlers()
    yield
    leftover = rank_processes()
    assert leftover == [], f"processes left behind: {leftover}"
    # A thread an earlier test left to end by itself may end meanwhile: only new ones count.
    new_threads = [t.name for t in threading.enumerate() if t not in threads_before]
    assert new_threads == [], f"threads left running: {new_threads}"
    assert _environ() == environ_before
    assert _signal_handlers() == handlers_before
    new_fds = set(os.listdir("/proc/self/fd")) - fds_before
    # The forkserver and resource tracker, started once per process, keep one pipe each.
    helpers = {fd for fd in new_fds if _is_helper_fd(fd)}
    # One that closed between the listing and its description was not left open. An eventfd
    # alone is not counted: under pytest-xdist some were seen opening during launches after
    # other tests had run in the same worker (their source is not known; a launch alone
    # leaves none); a launch that leaked its store would leave its sockets too, and those count.
    # Nor is an anonymous temporary file (tempfile.TemporaryFile, "/tmp/#<inode> (deleted)"):
    # the package makes none, while pytest's capfd makes one per captured stream, and a
    # busy machine's run once saw three outlive a test that asked for capfd.
    leaked = {
        fd: what
        for fd in new_fds - helpers
        if (what := _describe_fd(fd)) not in ("closed", "anon_inode:[eventfd]")
        and not _ANONYMOUS_TEMPORARY_FILE.match(what)
    }
    assert _still_open(leaked) == {}, f"descriptors left open: {leaked}"


_ANONYMOUS_TEMPORARY_FILE = re.compile(r"/.*/#\d+ \(deleted\)\Z")


def _still_open(descriptors: dict[str, str], safety_net_s: float = 10.0) -> dict[str, str]:
    """Those of ``descriptors`` that stay open: the same file under the same number.

    A client another test left in this worker (a kernel's ZeroMQ sockets reconnecting to a
    kernel that is gone) opens and closes sockets of its own at any moment; such a socket
    closes by itself, while one a launch leaked stays until the process ends.
    """
    deadline = time.monotonic() + safety_net_s
    while True:
        left = {fd: what for fd, what in descriptors.items() if _describe_fd(fd) == what}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _signal_handlers() -> dict[int, object]:
    import signal

    return {
        s: signal.getsignal(s)
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE)
    }


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def _describe_fd(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "closed"


def _is_helper_fd(fd: str) -> bool:
    from multiprocessing import forkserver, resource_tracker

    known = {
        getattr(forkserver._forkserver, "_forkserver_alive_fd", None),
        getattr(resource_tracker._resource_tracker, "_fd", None),
    }
    return int(fd) in known


@pytest.fixture
def fake_gpus(tmp_path, monkeypatch):
    """Put a fake nvidia-smi on PATH reporting the given GPUs; detection is re-run."""

    def install(*gpus: tuple[str, int, str], driver: str = "550.54") -> None:
        lines = "\n".join(
            f"{i}, {name}, {memory}, {cap}, {driver}" for i, (name, memory, cap) in enumerate(gpus)
        )
        script = tmp_path / "bin" / "nvidia-smi"
        script.parent.mkdir(exist_ok=True)
        script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{lines}\nEOF\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        hardware.detect(refresh=True)

    yield install
    monkeypatch.undo()
    hardware.detect(refresh=True)


def run_script(source: str, tmp_path: Path, timeout: float = 600) -> str:
    """Run ``source`` as a __main__ script in a fresh interpreter; return its stdout."""
    import subprocess

    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )
    assert done.returncode == 0, f"script failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout
