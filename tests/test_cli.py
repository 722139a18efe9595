"""The ``notebook-launcher`` command, run as a real subprocess the way a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from notebook_launcher import defaults, hardware
from tests.support.ports import free_port

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]


def cli(*words: str, timeout: float = 180, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "notebook_launcher", *words],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def write_script(tmp_path: Path, source: str, name: str = "train.py") -> Path:
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    return script


def assert_no_process_left(pid_dir: Path) -> None:
    """Ranks write their pid into ``pid_dir``; none of them may still exist."""
    pids = [int(p.read_text()) for p in pid_dir.glob("*.pid")]
    assert pids, "the ranks never started"
    alive = [
        pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
    ]
    assert alive == []


# --help and bad arguments -------------------------------------------------------------


def test_help_names_both_commands_and_an_example():
    done = cli("--help")
    assert done.returncode == 0
    assert "env" in done.stdout and "run" in done.stdout
    assert "run train.py -n 4 --mixed-precision bf16 -- --epochs 3" in done.stdout


def test_run_help_explains_the_options_and_where_script_arguments_go():
    done = cli("run", "--help")
    assert done.returncode == 0
    for option in (
        "--num-processes",
        "--mixed-precision",
        "--start-method",
        "--timeout",
        "--output",
    ):
        assert option in done.stdout
    assert "Arguments after -- are the script's own" in " ".join(done.stdout.split())


@pytest.mark.parametrize(
    ("words", "message"),
    [
        ((), "the following arguments are required: COMMAND"),
        (("bogus",), "invalid choice: 'bogus'"),
        (("run",), "the following arguments are required: SCRIPT"),
        (("run", "missing.py"), "the script 'missing.py' does not exist or is not a file"),
        (("run", "{script}", "-n", "0"), "-n/--num-processes: must be at least 1, got 0"),
        (("run", "{script}", "-n", "two"), "expected a whole number, got 'two'"),
        (("run", "{script}", "--mixed-precision", "fp9"), "invalid choice: 'fp9'"),
        (("run", "{script}", "--timeout", "-1"), "must be more than 0, got -1"),
        (
            ("run", "{script}", "--epochs", "3"),
            "unrecognized arguments: --epochs 3; the script's own arguments go after --",
        ),
        (
            ("run", "{script}", "--mixed-precision", "fp8"),
            "mixed_precision='fp8' cannot run here: fp8 needs a Hopper-class NVIDIA GPU",
        ),
        (("env", "--yaml"), "unrecognized arguments: --yaml"),
        (("run", "{script}", "--max-restarts", "-1"), "--max-restarts: must be at least 0, got -1"),
        (
            ("run", "{script}", "--num-nodes", "2", "--node-rank", "2"),
            "node_rank=2 but num_nodes=2",
        ),
        (
            ("run", "{script}", "--rdzv-conf", "join_timeout"),
            "--rdzv-conf: expected KEY=VALUE pairs separated by commas, got 'join_timeout'",
        ),
        (
            ("run", "{script}", "--rdzv-conf", "read_timeout=5"),
            "rdzv_conf has 'read_timeout', which this launcher does not use",
        ),
    ],
)
def test_bad_arguments_give_one_line_and_exit_code_2(tmp_path, words, message):
    script = write_script(tmp_path, "print('never runs')\n")
    done = cli(*(w.format(script=script) for w in words), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("notebook-launcher: error: ")
    assert message in lines[0]


# env ----------------------------------------------------------------------------------


def test_env_json_is_the_report_the_sidebar_shows():
    done = cli("env", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    report = hardware.detect()
    assert data["hardware"] == json.loads(json.dumps(report.to_dict()))
    assert data["choices"] == json.loads(json.dumps(defaults.choices(report)))
    assert data["versions"]["torch"] == report.torch_version
    assert data["versions"]["notebook-launcher"]
    assert data["system"]["python"] == report.python_version


def test_env_shows_faked_gpus_in_text_and_json(fake_gpus):
    fake_gpus(("NVIDIA H100 80GB HBM3", 81559, "9.0"), ("NVIDIA H100 80GB HBM3", 81559, "9.0"))
    data = json.loads(cli("env", "--json").stdout)
    assert [g["name"] for g in data["hardware"]["gpus"]] == ["NVIDIA H100 80GB HBM3"] * 2
    assert data["hardware"]["accelerator"] == "cuda"
    assert data["hardware"]["precisions"]["fp8"] is None
    text = cli("env").stdout
    assert "GPUs            2 (driver 550.54)" in text
    assert "cuda:1" in text and "NVIDIA H100 80GB HBM3, 81559 MiB, compute capability 9.0" in text


def test_env_text_lists_hardware_precisions_and_versions():
    done = cli("env")
    assert done.returncode == 0, done.stderr
    assert f"CPU cores       {hardware.detect().cpu_count} available" in done.stdout
    assert "fp8           no: fp8 needs a Hopper-class NVIDIA GPU" in done.stdout
    assert f"torch             {hardware.detect().torch_version}" in done.stdout
    assert "saved defaults" in done.stdout


def test_console_script_entry_point_is_the_cli_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["notebook-launcher"].partition(":")
    from notebook_launcher import cli as cli_module

    assert module == cli_module.__name__
    assert getattr(cli_module, name) is cli_module.main


# run ----------------------------------------------------------------------------------

RANK_SCRIPT = """
    import os, sys, time
    from pathlib import Path

    Path(os.environ["PID_DIR"], os.environ["RANK"] + ".pid").write_text(str(os.getpid()))

    def main():
        rank = os.environ["RANK"]
        print(f"rank {rank} of {os.environ['WORLD_SIZE']} argv={sys.argv[1:]} "
              f"precision={os.environ['ACCELERATE_MIXED_PRECISION']} name={__name__}")
        if "--fail" in sys.argv and rank == "1":
            raise ValueError(f"rank {rank} rejects the data")
        if "--hang" in sys.argv:
            print("waiting", flush=True)
            time.sleep(600)

    if __name__ == "__main__":
        main()
"""


def test_run_starts_the_script_on_n_ranks_with_its_arguments(tmp_path):
    script = write_script(tmp_path, RANK_SCRIPT)
    done = cli(
        "run",
        str(script),
        "-n",
        "3",
        "--mixed-precision",
        "bf16",
        "--",
        "--epochs",
        "3",
        "-n",
        "9",
        env={**os.environ, "PID_DIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        f"[rank{r}]: rank {r} of 3 argv=['--epochs', '3', '-n', '9'] precision=bf16 name=__main__"
        for r in range(3)
    ]
    assert_no_process_left(tmp_path)


def test_run_with_a_failing_rank_exits_1_with_its_traceback(tmp_path):
    script = write_script(tmp_path, RANK_SCRIPT)
    done = cli(
        "run", str(script), "-n", "2", "--", "--fail", env={**os.environ, "PID_DIR": str(tmp_path)}
    )
    assert done.returncode == 1
    assert (
        "raised ValueError: rank 1 rejects the data. The other ranks were stopped." in done.stderr
    )
    assert "Traceback from rank 1:" in done.stderr
    assert f'File "{script}", line 12, in main' in done.stderr
    assert_no_process_left(tmp_path)


@pytest.mark.slow(reason="the command line's ranks fail and start again")
def test_run_restarts_failed_ranks_with_max_restarts(tmp_path):
    script = write_script(
        tmp_path,
        """
        import os
        from pathlib import Path

        marker = Path("failed-once")
        if os.environ["RANK"] == "1" and not marker.exists():
            marker.write_text("")
            raise RuntimeError("first attempt fails")
        print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], "done")
    """,
    )
    done = cli("run", str(script), "-n", "2", "--max-restarts", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (
        "notebook_launcher: restart 1 of 2: rank 1 failed with RuntimeError: first attempt fails"
        in done.stderr
    )
    # Rank 0 may finish attempt 0 before rank 1 fails; attempt 1 runs both again.
    assert {"[rank0]: attempt 1 done", "[rank1]: attempt 1 done"} <= set(done.stdout.splitlines())
    assert "[rank1]: attempt 0 done" not in done.stdout


@pytest.mark.slow(reason="the command line's ranks run until its timeout")
def test_run_past_its_timeout_exits_1_and_stops_every_rank(tmp_path):
    script = write_script(tmp_path, RANK_SCRIPT)
    done = cli(
        "run",
        str(script),
        "-n",
        "2",
        "--timeout",
        "5",
        "--",
        "--hang",
        env={**os.environ, "PID_DIR": str(tmp_path)},
    )
    assert done.returncode == 1
    assert "the launch ran past timeout=5s" in done.stderr
    assert_no_process_left(tmp_path)


@pytest.mark.slow(reason="the command line's ranks started, then interrupted")
def test_interrupting_run_stops_every_rank_and_exits_130(tmp_path):
    script = write_script(tmp_path, RANK_SCRIPT)
    process = subprocess.Popen(
        [sys.executable, "-m", "notebook_launcher", "run", str(script), "-n", "2", "--", "--hang"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PID_DIR": str(tmp_path)},
    )
    try:
        waiting = 0
        assert process.stdout is not None
        while waiting < 2:  # both ranks are in the script
            line = process.stdout.readline()
            assert line, process.stderr.read() if process.stderr else ""
            waiting += line.endswith("waiting\n")
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=600)  # a safety net: it exits in seconds
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 130
    assert "interrupted; every rank was stopped" in stderr
    deadline = time.monotonic() + 120  # a safety net: the loop ends as soon as they are gone
    while time.monotonic() < deadline:  # the interpreter exits before its orphans are reaped
        try:
            assert_no_process_left(tmp_path)
            break
        except AssertionError:
            time.sleep(0.2)
    assert_no_process_left(tmp_path)


@pytest.mark.slow(
    reason="the command line starts a rendezvous and its ranks in processes of their own"
)
def test_run_passes_rdzv_conf_to_the_rendezvous(tmp_path):
    script = write_script(tmp_path, "print('never runs')\n")
    endpoint = f"127.0.0.1:{free_port()}"  # nobody hosts it
    done = cli(
        "run",
        str(script),
        "-n",
        "1",
        "--num-nodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-conf",
        "join_timeout=2,last_call_timeout=1",
    )
    assert done.returncode == 1, done.stderr
    assert (
        f"node_rank=1 could not reach the rendezvous store at {endpoint} within join_timeout=2s"
        in done.stderr
    )


def test_a_script_sees_its_name_as_typed_in_argv_0(tmp_path):
    write_script(tmp_path, "import sys\nprint('argv0', sys.argv[0])\n")
    done = cli("run", "train.py", "-n", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[rank0]: argv0 train.py"]


def test_run_started_with_sigint_ignored_can_still_be_interrupted(tmp_path):
    """As a shell leaves it for `notebook-launcher run ... &`."""
    script = write_script(tmp_path, RANK_SCRIPT)
    process = subprocess.Popen(
        [sys.executable, "-m", "notebook_launcher", "run", str(script), "-n", "1", "--", "--hang"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PID_DIR": str(tmp_path)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert process.stdout is not None
        while not process.stdout.readline().endswith("waiting\n"):
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=600)  # a safety net: it exits in seconds
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 130, stderr
    assert "interrupted; every rank was stopped" in stderr
