"""The registry of running launches: what a launch of a dead kernel leaves is cleared."""

from __future__ import annotations

import json
import os
import subprocess
import time

import psutil
import pytest

from notebook_launcher import notebook_launcher, rank_env, registry
from notebook_launcher.registry import LaunchRecord


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()  # reaped: nothing runs under this pid now
    return process.pid


def left_behind(launch_id: str, pid_namespace: str) -> None:
    record = LaunchRecord(launch_id, None, dead_pid(), 1, "cpu", "no", "fork", "running", time.time(),
                          pid_namespace=pid_namespace)  # fmt: skip
    directory = registry.registry_dir()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{launch_id}.json").write_text(json.dumps(record.to_dict()))


def daemon_of(launch_id: str) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "305"], env={**os.environ, rank_env.LAUNCH_ID: launch_id},
                            start_new_session=True)  # fmt: skip


def test_the_daemon_of_a_launch_whose_kernel_died_is_ended_by_the_next_listing(runtime_dir):
    here = os.readlink("/proc/self/ns/pid")
    daemon = daemon_of("abc123")  # first: a listing that finds the record finds it too
    left_behind("abc123", here)
    try:
        assert registry.list_launches() == []
        assert daemon.wait(timeout=120) == -9  # a safety net: it was sent SIGKILL
        assert list(registry.registry_dir().iterdir()) == []
    finally:
        daemon.kill()
        daemon.wait()


def test_a_record_from_another_pid_namespace_ends_nothing(runtime_dir):
    # Its pid means nothing here: the launch may well be running (in a container, say).
    daemon = daemon_of("def456")  # first: a listing that finds the record finds it too
    left_behind("def456", "pid:[1]")
    try:
        assert registry.list_launches() == []
        assert psutil.Process(daemon.pid).status() != psutil.STATUS_ZOMBIE and daemon.poll() is None
    finally:
        daemon.kill()
        daemon.wait()


def test_a_zombie_kernel_counts_as_dead(runtime_dir):
    kernel = subprocess.Popen(["sleep", "306"])
    kernel.kill()
    psutil.Process(kernel.pid)  # still there, unreaped
    while psutil.Process(kernel.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    record = LaunchRecord(
        "aaa111", None, kernel.pid, 1, "cpu", "no", "fork", "running", time.time()
    )
    registry.RegisteredLaunch(record)
    assert registry.list_launches() == []
    kernel.wait()


def one() -> int:
    return 1


@pytest.fixture
def unusable_runtime_dir(tmp_path, monkeypatch):
    path = tmp_path / "not a directory"
    path.write_text("")  # every listing and write below it fails
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(path))


def test_an_unusable_runtime_directory_never_stops_a_launch(unusable_runtime_dir, leak_check):
    assert notebook_launcher(one, num_processes=1) == 1
