"""A rank killed by the kernel's OOM killer is named so: out of memory, the limit it hit,
its last resident memory. A real kill inside a memory cgroup made for the test (as root),
and the reading of cgroup files, v1 and v2, nested, from faked /proc and mount tables."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from notebook_launcher.errors import RankFailure
from notebook_launcher.launcher import memory_deaths

REPO = pathlib.Path(__file__).resolve().parents[2]
LIMIT = 700 * 2**20

SCRIPT = """
import threading, time
import torch
from notebook_launcher import notebook_launcher
from notebook_launcher.errors import RankFailedError

def grow():
    import os
    if os.environ["RANK"] == "1":
        held = []
        while True:  # 40 MB more every 0.1 s, touched, until the cgroup's limit is hit
            held.append(torch.ones(10 * 2**20))
            time.sleep(0.1)
    threading.Event().wait()  # rank 0 waits until the launch stops it

try:
    notebook_launcher(grow, num_processes=2, dashboard=False)
except RankFailedError as error:
    print("ERROR:", str(error).splitlines()[0])
    print("FAILURE:", repr(error.failures[0].out_of_memory))
"""


def _own_v1_memory_cgroup() -> pathlib.Path | None:
    mount = pathlib.Path("/sys/fs/cgroup/memory")
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, name = line.split(":", 2)
            if "memory" in controllers.split(","):
                return mount / name.lstrip("/")
    return None


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[pathlib.Path]:
    """A child of this process's v1 memory cgroup, limited to ``limit`` bytes, no swap."""
    parent = _own_v1_memory_cgroup()
    if parent is None or not (parent / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory hierarchy at /sys/fs/cgroup/memory to make a limit in")
    child = parent / f"notebook-launcher-oom-{os.getpid()}"
    try:
        child.mkdir()
    except OSError as error:
        pytest.skip(f"a memory cgroup cannot be made here ({error}); it needs root")
    try:
        (child / "memory.limit_in_bytes").write_text(str(limit))
        with contextlib.suppress(OSError):  # no swap accounting: nothing to swap to anyway
            (child / "memory.memsw.limit_in_bytes").write_text(str(limit))
        yield child
    finally:
        for _ in range(50):
            try:
                child.rmdir()
                break
            except OSError:  # a process of the test still ending
                procs = (child / "cgroup.procs").read_text().split()
                for pid in procs:
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), 9)
                with contextlib.suppress(OSError):
                    os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG)


@pytest.mark.slow(reason="a rank grows until the OOM killer ends it")
@pytest.mark.timeout(300)
def test_a_rank_killed_by_the_oom_killer_in_a_memory_cgroup_is_named_out_of_memory(tmp_path):
    script = tmp_path / "grow.py"
    script.write_text(textwrap.dedent(SCRIPT))
    with memory_cgroup(LIMIT) as cgroup:

        def enter_cgroup() -> None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=240,
            preexec_fn=enter_cgroup,
            env={**os.environ, "PYTHONPATH": str(REPO), "JUPYTER_RUNTIME_DIR": str(tmp_path)},
        )
        kills = re.search(r"oom_kill (\d+)", (cgroup / "memory.oom_control").read_text())
    assert done.returncode == 0, done.stderr
    assert kills and int(kills.group(1)) >= 1  # the kernel did kill in the cgroup
    error = next(line for line in done.stdout.splitlines() if line.startswith("ERROR:"))
    assert re.fullmatch(
        rf"ERROR: Rank 1 \(pid \d+\) was killed by SIGKILL: out of memory: the kernel's OOM "
        rf"killer ended it at the memory limit of 734 MB of its cgroup {re.escape(str(cgroup))}; "
        r"its last resident memory \(RSS\) reported was \d+ MB\. The other ranks were stopped\.",
        error,
    ), error


def test_the_cgroup_v2_hierarchy_here_has_a_memory_controller_or_the_v2_kill_is_skipped():
    controllers = pathlib.Path("/sys/fs/cgroup/unified/cgroup.controllers")
    if not controllers.exists() or "memory" not in controllers.read_text().split():
        pytest.skip(
            "cgroup v2 at /sys/fs/cgroup/unified has no memory controller on this machine (it is "
            "bound to v1): a real v2 kill cannot be made; v2 files are read in the next tests"
        )


def _fake_machine(
    tmp_path: pathlib.Path, version: int, limit: str
) -> tuple[str, str, pathlib.Path]:
    """A /proc and a mount table naming a nested cgroup of ``version`` under a namespace root."""
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    mount = tmp_path / "cg"
    leaf = mount / "job" / "rank"
    leaf.mkdir(parents=True)
    if version == 2:
        (proc / "42" / "cgroup").write_text("0::/ns/job/rank\n")
        mountinfo = f"41 31 0:38 /ns {mount} rw,relatime - cgroup2 cgroup2 rw\n"
        (mount / "job" / "memory.max").write_text(limit + "\n")
        (leaf / "memory.max").write_text("max\n")
        events = leaf / "memory.events"
        events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\n")
    else:
        (proc / "42" / "cgroup").write_text("5:devices:/\n4:memory:/ns/job/rank\n0::/\n")
        mountinfo = (
            f"35 31 0:32 /ns {mount} rw,relatime - cgroup cgroup rw,memory\n"
            f"36 31 0:33 / {tmp_path / 'devices'} rw,relatime - cgroup cgroup rw,devices\n"
        )
        (mount / "job" / "memory.limit_in_bytes").write_text(limit + "\n")
        (leaf / "memory.limit_in_bytes").write_text("9223372036854771712\n")
        events = leaf / "memory.oom_control"
        events.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    (tmp_path / "mountinfo").write_text(mountinfo)
    return str(proc), str(tmp_path / "mountinfo"), events


@pytest.mark.parametrize("version", [1, 2])
def test_the_oom_kill_counter_of_a_nested_cgroup_names_the_smallest_limit_above(tmp_path, version):
    proc, mountinfo, events = _fake_machine(tmp_path, version, str(300 * 10**6))
    watches = memory_deaths.watch(42, proc=proc, mountinfo=mountinfo)
    assert [(w.version, w.name, w.oom_kills) for w in watches] == [(version, "/ns/job/rank", 0)]
    assert memory_deaths.oom_reason(watches, 42, 290 * 10**6, 0.0, kmsg="/absent") is None
    events.write_text(events.read_text().replace("oom_kill 0", "oom_kill 1"))
    reason = memory_deaths.oom_reason(watches, 42, 290 * 10**6, 0.0, kmsg="/absent")
    assert reason == (
        "out of memory: the kernel's OOM killer ended it at the memory limit of 300 MB of its "
        f"cgroup {tmp_path / 'cg' / 'job'}; its last resident memory (RSS) reported was 290 MB"
    )
    failure = RankFailure(1, 42, -9, out_of_memory=reason)
    assert failure.summary().startswith("Rank 1 (pid 42) was killed by SIGKILL: out of memory: ")


def test_no_limit_below_the_machines_ram_names_the_machines_ram(tmp_path):
    proc, mountinfo, events = _fake_machine(tmp_path, 2, "max")
    watches = memory_deaths.watch(42, proc=proc, mountinfo=mountinfo)
    events.write_text(events.read_text().replace("oom_kill 0", "oom_kill 2"))
    reason = memory_deaths.oom_reason(watches, 42, None, 0.0, kmsg="/absent")
    assert reason is not None
    assert re.fullmatch(
        r"out of memory: the kernel's OOM killer ended it at the machine's RAM \(\d+ GB\)", reason
    )


def test_without_cgroups_the_kernel_log_names_the_kill_of_this_pid_only_if_recent(tmp_path):
    kmsg = tmp_path / "kmsg"
    kmsg.write_bytes(b"3,1201,5000000,-;Out of memory: Killed process 4242 (python) total-vm:1kB\n")
    assert memory_deaths.watch(4242, proc=str(tmp_path / "none")) == []
    said = memory_deaths.oom_reason([], 4242, 10**9, 4.0, kmsg=str(kmsg))
    assert said is not None and said.startswith("out of memory: the kernel's OOM killer ended it")
    assert said.endswith("its last resident memory (RSS) reported was 1.0 GB")
    # A line from before the rank started names another process that had its pid.
    assert memory_deaths.oom_reason([], 4242, None, 60.0, kmsg=str(kmsg)) is None
    assert memory_deaths.oom_reason([], 424, None, 4.0, kmsg=str(kmsg)) is None


def test_a_sigkill_from_outside_is_still_worded_as_before():
    assert RankFailure(1, 42, -9).summary() == (
        "Rank 1 (pid 42) was killed by SIGKILL (killed: out of memory, or stopped from outside)"
    )


def test_a_launchs_ranks_in_one_cgroup_share_one_reading_and_another_cgroup_gets_its_own(tmp_path):
    proc, mountinfo, _ = _fake_machine(tmp_path, 2, str(300 * 10**6))
    shutil.copytree(f"{proc}/42", f"{proc}/43")  # a second rank, member of the same cgroup
    (pathlib.Path(proc) / "44").mkdir()
    (pathlib.Path(proc) / "44" / "cgroup").write_text("0::/ns/job\n")  # one moved elsewhere
    (tmp_path / "cg" / "job" / "memory.events").write_text("oom_kill 5\n")
    group = memory_deaths.GroupWatch(proc, mountinfo)
    first = group.watch(42)
    pathlib.Path(mountinfo).unlink()  # read once: the second rank of the same cgroup needs it not
    assert group.watch(43) is first
    assert [(w.name, w.oom_kills) for w in group.watch(44)] == [("/ns/job", 5)]
    assert group.watch(45) == []  # gone before it was asked
