"""Ending what a launch's ranks started, found by the launch id in their environment."""

from __future__ import annotations

import os
import subprocess
import uuid

import psutil

from notebook_launcher import descendants, rank_env


def ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def marked_env(launch_id: str) -> dict[str, str]:
    return {**os.environ, rank_env.LAUNCH_ID: launch_id}


def test_the_marked_processes_have_ended_when_it_returns():
    launch_id = uuid.uuid4().hex
    daemons = [
        subprocess.Popen(["sleep", "300"], env=marked_env(launch_id), start_new_session=True)
        for _ in range(3)
    ]
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)  # not of this launch
    try:
        signalled = descendants.end_marked_processes(launch_id, wait_s=120)
        assert sorted(signalled) == sorted(d.pid for d in daemons)
        assert all(ended(d.pid) for d in daemons)  # no wait: ended before it returned
        assert not ended(stranger.pid)
    finally:
        stranger.kill()
        for process in [*daemons, stranger]:
            process.wait()


def test_a_daemon_that_keeps_starting_others_is_ended_with_all_it_started(tmp_path):
    launch_id = uuid.uuid4().hex
    started = tmp_path / "started"
    # Starts a new process in a new session as fast as it can, and says when it has.
    spawner = subprocess.Popen(
        ["sh", "-c", f"while true; do setsid sleep 300 & echo $! >> {started}; done"],
        env=marked_env(launch_id),
        start_new_session=True,
    )
    try:
        while not (started.exists() and len(started.read_text().split()) >= 5):
            assert spawner.poll() is None
        descendants.end_marked_processes(launch_id, wait_s=120)
        assert ended(spawner.pid)
        assert descendants.marked_processes(launch_id) == []
        assert all(ended(int(pid)) for pid in started.read_text().split())
    finally:
        spawner.kill()
        spawner.wait()


def test_spared_pids_are_neither_signalled_nor_waited_for():
    launch_id = uuid.uuid4().hex
    rank = subprocess.Popen(["sleep", "300"], env=marked_env(launch_id))
    try:
        assert descendants.end_marked_processes(launch_id, wait_s=120, spare={rank.pid}) == []
        assert rank.poll() is None
    finally:
        rank.kill()
        rank.wait()


def test_what_a_process_started_has_ended_when_it_returns(tmp_path):
    started = tmp_path / "started"
    parent = subprocess.Popen(
        ["sh", "-c", f"sleep 300 & echo $! >> {started}; sleep 301 & echo $! >> {started}; wait"]
    )
    try:
        while not (started.exists() and len(started.read_text().split()) == 2):
            assert parent.poll() is None
        children = [int(pid) for pid in started.read_text().split()]
        assert sorted(descendants.end_descendants(parent.pid, wait_s=120)) == sorted(children)
        assert all(ended(pid) for pid in children)
    finally:
        parent.kill()
        parent.wait()
