"""The running-launches endpoints: list what the registry holds, ask a launch to stop."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from notebook_launcher import registry
from notebook_launcher.registry import LaunchRecord, RegisteredLaunch
from tests.support.server import *  # noqa: F403  (a real server, and the api caller)
from tests.support.server import Api


def _record(launch_id: str, kernel_id: str | None, pid: int, **changes: Any) -> LaunchRecord:
    record = LaunchRecord(
        launch_id=launch_id,
        kernel_id=kernel_id,
        kernel_pid=pid,
        num_processes=2,
        accelerator="cpu",
        mixed_precision="bf16",
        start_method="fork",
        state="running",
        started_at=time.time() - 5.0,
        rank_pids=[pid + 1, pid + 2],
    )
    return LaunchRecord(**{**record.to_dict(), **changes})


@pytest.fixture
def running(api: Api) -> Iterator[RegisteredLaunch]:
    """A launch registered by a live process (this one), as a kernel's launcher would."""
    launch = RegisteredLaunch(_record("a1b2c3", None, os.getpid()))
    yield launch
    launch.close()


def test_no_launches_when_nothing_runs(api: Api) -> None:
    status, body = api("launches")
    assert status == 200
    assert body["launches"] == []
    assert abs(body["now"] - time.time()) < 60


def test_a_running_launch_is_listed(api: Api, running: RegisteredLaunch) -> None:
    status, body = api("launches")
    assert status == 200
    listed = {
        k: v for k, v in running.record.to_dict().items() if k != "pid_namespace"
    }  # the kernel's own
    assert body["launches"] == [{**listed, "notebook": None}]


def test_the_list_follows_state_changes_and_the_end_of_a_launch(
    api: Api, running: RegisteredLaunch
) -> None:
    running.update(state="stopping")
    assert [x["state"] for x in api("launches")[1]["launches"]] == ["stopping"]
    running.close()
    assert api("launches")[1]["launches"] == []


def test_a_launch_whose_kernel_died_is_not_listed(api: Api) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    RegisteredLaunch(_record("dead01", None, int(dead.stdout)))
    assert api("launches")[1]["launches"] == []


def test_a_launch_names_its_notebook(api: Api) -> None:
    status, session = api(
        "api",
        "sessions",
        prefix="",
        method="POST",
        body={
            "path": "work/train.ipynb",
            "type": "notebook",
            "name": "train.ipynb",
            "kernel": {"name": "echo"},
        },
    )
    assert status == 201, session
    kernel_id = session["kernel"]["id"]
    launch = RegisteredLaunch(_record("b4d5e6", kernel_id, os.getpid()))
    try:
        launches = api("launches")[1]["launches"]
    finally:
        launch.close()
    assert [(x["kernel_id"], x["notebook"]) for x in launches] == [(kernel_id, "work/train.ipynb")]


def test_stop_asks_the_launch_to_stop(api: Api, running: RegisteredLaunch) -> None:
    assert not running.stop_requested()
    status, body = api("launches", "a1b2c3", "stop", method="POST", body="{}")
    assert (status, body) == (202, {"launch_id": "a1b2c3", "stop_requested": True})
    assert running.stop_requested()  # what the launch's monitor loop polls


@pytest.mark.parametrize("launch_id", ["ffffff", "..", "a1b2c3.json"])
def test_stopping_an_unknown_launch_is_a_404_that_says_so(
    api: Api, running: RegisteredLaunch, launch_id: str
) -> None:
    status, body = api("launches", launch_id, "stop", method="POST", body="{}")
    assert status == 404
    assert body == {
        "message": f"No running launch has the id {launch_id!r}; it may have finished already. "
        f"The list of launches shows the ones running now."
    }
    assert not running.stop_requested()
    assert sorted(p.name for p in registry.registry_dir().iterdir()) == ["a1b2c3.json"]


def test_a_session_is_listed_as_a_session(api: Api) -> None:
    session = RegisteredLaunch(_record("5e5510", None, os.getpid(), kind="session"))
    try:
        launches = api("launches")[1]["launches"]
    finally:
        session.close()
    assert [(x["launch_id"], x["kind"]) for x in launches] == [("5e5510", "session")]


def test_where_asks_a_session_and_the_list_shows_its_answer(api: Api) -> None:
    session = RegisteredLaunch(_record("5e5510", None, os.getpid(), kind="session"))
    try:
        status, body = api("launches", "5e5510", "where", method="POST", body="{}")
        assert (status, body) == (202, {"launch_id": "5e5510", "where_requested": True})
        assert session.where_requested()  # what the session's watcher polls
        assert not session.where_requested()  # asked once, answered once
        lines = ["rank 0: cell 3, line 2, in time.sleep", "rank 1: idle, waiting for the next cell"]
        session.update(where=lines, where_at=123.0)
        (listed,) = api("launches")[1]["launches"]
    finally:
        session.close()
    assert (listed["where"], listed["where_at"]) == (lines, 123.0)
    assert list(registry.registry_dir().iterdir()) == []


@pytest.mark.parametrize("launch_id", ["a1b2c3", "ffffff", "..", "a1b2c3.json"])
def test_where_for_anything_but_a_running_session_is_a_404_that_says_so(
    api: Api, running: RegisteredLaunch, launch_id: str
) -> None:
    # a1b2c3 runs, but as a launch of one function, whose ranks cannot say where they are.
    status, body = api("launches", launch_id, "where", method="POST", body="{}")
    assert status == 404
    assert body == {
        "message": f"No running session has the id {launch_id!r}: only a session's ranks can say "
        "where they are, and it may have ended. The list of launches shows the ones running now."
    }
    assert sorted(p.name for p in registry.registry_dir().iterdir()) == ["a1b2c3.json"]
