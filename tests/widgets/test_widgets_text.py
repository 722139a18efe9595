"""Progress from ranks reaches the dashboard, and where widgets cannot render (a script,
terminal IPython) the dashboard is plain text that ends with every rank's final state."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from notebook_launcher import notebook_launcher
from notebook_launcher.accelerator.utils import tqdm as core_tqdm
from notebook_launcher.launcher.events import RankProgress

pytestmark = pytest.mark.timeout(300)


class Collect:
    def __init__(self) -> None:
        self.events: list[object] = []

    def on_event(self, event: object) -> None:
        self.events.append(event)


def count_with_the_core_bar(steps):
    import time

    from notebook_launcher import Accelerator

    accelerator = Accelerator()
    for _ in accelerator.tqdm(range(steps), desc="train"):
        time.sleep(0.01)


def test_the_cores_tqdm_reports_every_ranks_count_and_shows_the_same_bar(capfd, leak_check):
    collect = Collect()
    notebook_launcher(
        count_with_the_core_bar, (30,), num_processes=2, observers=[collect], dashboard=False
    )
    progress = [e for e in collect.events if isinstance(e, RankProgress)]
    for rank in (0, 1):  # rank 1's bar is hidden (main_process_only), yet it reports
        mine = [(e.n, e.total, e.description) for e in progress if e.rank == rank]
        assert mine[-1] == (30, 30, "train")
        assert 2 <= len(mine) <= 10  # throttled: not one message per step
        assert [n for n, _, _ in mine] == sorted(n for n, _, _ in mine)
    _, err = capfd.readouterr()
    shown = [line for line in err.splitlines() if line.startswith("[rank")]
    assert shown[-1].startswith("[rank0]: train: 100%|") and "| 30/30 [" in shown[-1]
    assert not any(line.startswith("[rank1]") for line in shown)


def test_outside_a_launch_the_cores_tqdm_is_tqdms_own_bar():
    from tqdm.auto import tqdm

    bar = core_tqdm(range(3), disable=True)
    assert type(bar) is tqdm


SCRIPT = """
import time
from notebook_launcher import notebook_launcher

def train():
    from tqdm import tqdm
    from notebook_launcher import Accelerator
    accelerator = Accelerator()
    for step in tqdm(range(20), mininterval=0, ascii=True):
        time.sleep(0.005)
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
    accelerator.wait_for_everyone()  # rank 0's loop is over before rank 1 fails and it is stopped
    if accelerator.process_index == 1:
        raise ValueError("rank 1 gives up")
    time.sleep(30)

try:
    notebook_launcher(train, num_processes=2)
except ValueError as error:
    print("caught", str(error).splitlines()[0])
"""


def final_table(stderr: str) -> list[list[str]]:
    lines = stderr.splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.startswith("notebook_launcher: 2 x cpu ranks")
    )
    return [line.split() for line in lines[start + 1 : start + 4]]


def check_text_dashboard(stderr: str) -> None:
    assert "notebook_launcher: 2 x cpu ranks, fp32, fork: failed after" in stderr
    header, rank0, rank1 = final_table(stderr)
    assert header[:5] == ["rank", "state", "device", "pid", "elapsed"]
    assert rank0[:3] == ["0", "stopped", "cpu"] and "20/20" in rank0 and "loss=0.05" in rank0
    assert rank1[:3] == ["1", "failed", "cpu"] and " ".join(rank1).endswith(
        "ValueError: rank 1 gives up"
    )


def test_a_script_gets_the_text_dashboard(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "caught Rank 1 (pid" in done.stdout
    check_text_dashboard(done.stderr)


def test_terminal_ipython_gets_the_text_dashboard(tmp_path):
    script = tmp_path / "train.ipy"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run(
        [sys.executable, "-m", "IPython", "--no-banner", "--colors=nocolor", str(script)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "caught Rank 1" in done.stdout
    assert "widget" not in (done.stdout + done.stderr).lower()
    check_text_dashboard(done.stderr)
