"""A launch from a plain script leaves the script as it found it: no debugger imported, no
environment variable changed, no warning printed that the script's own code did not cause.

Each run is a fresh interpreter with warnings shown (``-W always``) or turned into errors
(``-W error``), as a user who runs with warnings on meets them. On the versions Colab and
Kaggle ship (ipykernel 6.17, Python 3.12 and 3.13) this found: debugpy imported by asking
ipykernel for a connection file (it sets PYDEVD_USE_FRAME_EVAL and prints pydevd's
warnings), and Python's warning about forking a process that has threads at every launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = """
    import json, os, sys, threading

    before = dict(os.environ)
    from notebook_launcher import notebook_launcher


    def job(value):
        return value * 2


    if __name__ == "__main__":
        # A thread of the script's own, as a kernel has: the fork then happens with threads.
        idle = threading.Event()
        threading.Thread(target=idle.wait, daemon=True).start()
        result = notebook_launcher(
            job, args=(21,), num_processes=2, start_method="fork", dashboard=False
        )
        idle.set()
        after = dict(os.environ)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        loaded = sorted(
            name for name in sys.modules
            if name.split(".")[0] in ("debugpy", "pydevd", "_pydevd_bundle", "ipykernel", "IPython")
        )
        print(json.dumps({"result": result, "changed": changed, "loaded": loaded}))
"""


def _run(tmp_path: Path, warnings_flag: str) -> tuple[dict, str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run(
        [sys.executable, "-W", warnings_flag, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, f"the script failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.slow(reason="a script launched in a process of its own, per warning filter")
@pytest.mark.parametrize("warnings_flag", ["always", "error"])
def test_a_script_launch_imports_no_debugger_changes_no_variable_and_warns_of_nothing(
    tmp_path, warnings_flag
):
    seen, stderr = _run(tmp_path, warnings_flag)
    assert seen["result"] == 42
    assert seen["changed"] == []  # PYDEVD_USE_FRAME_EVAL, among others
    # Neither a debugger nor the kernel's machinery: a script is no kernel.
    assert seen["loaded"] == []
    assert "Warning" not in stderr, stderr
    assert "pydevd" not in stderr and "Debugger warning" not in stderr, stderr


FORKS_IN_RANK = """
    import json, os, threading, warnings
    from notebook_launcher import notebook_launcher


    def job():
        # The rank's own fork, from a rank that has threads: Python's warning is the user's.
        idle = threading.Event()
        threading.Thread(target=idle.wait, daemon=True).start()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        idle.set()
        return [str(w.message) for w in caught]


    if __name__ == "__main__":
        idle = threading.Event()
        threading.Thread(target=idle.wait, daemon=True).start()
        shown = notebook_launcher(job, num_processes=2, start_method="fork", dashboard=False)
        idle.set()
        print(json.dumps(shown))
"""


@pytest.mark.skipif(
    sys.version_info < (3, 12), reason="Python warns of forks with threads from 3.12 on"
)
def test_forks_the_users_code_makes_in_a_rank_still_warn(tmp_path):
    script = tmp_path / "forks.py"
    script.write_text(textwrap.dedent(FORKS_IN_RANK))
    done = subprocess.run(
        [sys.executable, "-W", "always", str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(shown) == 1 and "is multi-threaded, use of fork()" in shown[0], shown
    assert "multi-threaded" not in done.stderr, done.stderr  # the launch's own fork: silent


@pytest.mark.kernel
def test_in_a_kernel_the_launch_record_names_the_kernel_from_its_connection_file(tmp_path):
    from tests.support.kernel_driver import started_kernel

    # Named as a Jupyter server names a kernel's connection file: kernel-<id>.json.
    manager = started_kernel(
        connection_file=str(tmp_path / "kernel-5e0c1d2a-0000-4000-8000-000000000001.json")
    )
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=600)
        reply = client.execute_interactive(
            "from notebook_launcher import registry\nkernel_id = registry.current_kernel_id()",
            user_expressions={"kernel_id": "kernel_id"},
            timeout=600,
        )
        shown = reply["content"]["user_expressions"]["kernel_id"]["data"]["text/plain"]
        assert shown == "'5e0c1d2a-0000-4000-8000-000000000001'"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
