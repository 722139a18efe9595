"""Elastic restarts (``max_restarts``) and rank failures as torch elastic's ChildFailedError."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from notebook_launcher import (
    LaunchConfigError,
    LaunchTimeoutError,
    RankFailedError,
    notebook_launcher,
)
from tests.support.ports import free_port


def fails_until_counter_reaches(counter: str, needed: int):
    """Rank 1 fails while the shared counter file is short; every rank logs its attempt."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    with open(counter + ".log", "a") as log:
        log.write(f"{attempt} {os.environ['RANK']} {os.getpid()}\n")
    if os.environ["RANK"] == "1":
        with open(counter, "a") as file:
            file.write("x")
        if len(Path(counter).read_text()) < needed:
            raise ValueError(f"attempt {attempt} fails")
    dist.barrier()
    return f"attempt {attempt} of rank {os.environ['RANK']}"


def test_max_restarts_restarts_the_whole_group_and_says_so(tmp_path, capfd, leak_check):
    counter = str(tmp_path / "counter")
    value = notebook_launcher(
        fails_until_counter_reaches, (counter, 3), num_processes=2, max_restarts=3
    )
    assert value == "attempt 2 of rank 0"
    err = capfd.readouterr().err
    assert (
        "notebook_launcher: restart 1 of 3: rank 1 failed with ValueError: attempt 0 fails" in err
    )
    assert (
        "notebook_launcher: restart 2 of 3: rank 1 failed with ValueError: attempt 1 fails" in err
    )
    assert "restart 3 of 3" not in err
    # Every attempt ran both ranks as new processes: the whole group was restarted.
    runs = [line.split() for line in Path(counter + ".log").read_text().splitlines()]
    assert sorted((a, r) for a, r, _ in runs) == [(a, r) for a in "012" for r in "01"]
    assert len({pid for _, _, pid in runs}) == 6


def test_when_restarts_run_out_the_last_failure_is_raised(tmp_path, capfd, leak_check):
    counter = str(tmp_path / "counter")
    with pytest.raises(
        ValueError, match=r"Rank 1 \(pid \d+\) raised ValueError: attempt 2 fails"
    ) as caught:
        notebook_launcher(
            fails_until_counter_reaches, (counter, 99), num_processes=2, max_restarts=2
        )
    assert isinstance(caught.value, RankFailedError)
    err = capfd.readouterr().err
    assert err.count("notebook_launcher: restart ") == 2
    assert "restart 2 of 2: rank 1 failed with ValueError: attempt 1 fails" in err


def sleeps(seconds: float) -> None:
    time.sleep(seconds)


def test_a_timeout_is_not_restarted(capfd, leak_check):
    with pytest.raises(LaunchTimeoutError, match=r"ran past timeout=3s"):
        notebook_launcher(sleeps, (120,), num_processes=2, max_restarts=3, timeout=3)
    assert "restart" not in capfd.readouterr().err


def test_a_crash_without_exception_is_restarted_and_named(tmp_path, capfd, leak_check):
    marker = tmp_path / "crashed"

    def crash_once():
        if os.environ["RANK"] == "0" and not marker.exists():
            marker.write_text("")
            os._exit(3)
        return os.environ["TORCHELASTIC_RESTART_COUNT"]

    assert (
        notebook_launcher(crash_once, num_processes=2, max_restarts=1, start_method="fork") == "1"
    )
    assert "restart 1 of 1: rank 0 failed with exit code 3" in capfd.readouterr().err


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (-1, LaunchConfigError, r"max_restarts must be at least 0; got -1\."),
        ("3", LaunchConfigError, r"max_restarts must be a whole number; got str '3'\."),
        (1.5, LaunchConfigError, r"max_restarts must be a whole number; got float 1\.5\."),
    ],
)
def test_bad_max_restarts_is_refused_before_anything_starts(value, error, message):
    with pytest.raises(error, match=message):
        notebook_launcher(sleeps, (0,), max_restarts=value)


# RankFailedError is also torch elastic's ChildFailedError --------------------------------


def raises_on_rank_1():
    if os.environ["RANK"] == "1":
        raise KeyError("missing column 'label'")
    time.sleep(60)


def test_a_rank_failure_is_also_childfailederror_keeping_the_rank_type(leak_check):
    with pytest.raises(ChildFailedError, match="missing column 'label'") as caught:
        notebook_launcher(raises_on_rank_1, num_processes=2, monitor_interval=0.01)
    error = caught.value
    assert isinstance(error, KeyError)
    assert isinstance(error, RankFailedError)
    rank, failure = error.get_first_failure()
    assert rank == 1
    assert failure.message.startswith("Rank 1 (pid ")
    assert error.format_msg() == str(error)
    assert [f.rank for f in error.failures] == [1]


def test_the_errors_module_imports_and_builds_errors_without_torch():
    code = """
import sys
from notebook_launcher.errors import RankFailedError, rank_failed_error_class
cls = rank_failed_error_class(ValueError)
assert issubclass(cls, ValueError) and issubclass(cls, RankFailedError)
assert "torch" not in sys.modules, "torch was imported"
assert not any(c.__name__ == "ChildFailedError" for c in cls.__mro__)
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.kernel
def test_restarts_are_announced_in_the_notebook_cell(tmp_path):
    from tests.support.kernel_driver import RunningKernel

    kernel = RunningKernel()
    try:
        cell = kernel.run(
            f"""
            import os
            from pathlib import Path
            from notebook_launcher import notebook_launcher

            counter = Path({str(tmp_path / "counter")!r})
            def train():
                if os.environ["RANK"] == "1":
                    with open(counter, "a") as file:
                        file.write("x")
                    if len(counter.read_text()) < 3:
                        raise ValueError("loss is nan")
                return "trained after " + os.environ["TORCHELASTIC_RESTART_COUNT"] + " restarts"

            notebook_launcher(train, num_processes=2, max_restarts=3)
            """
        )
    finally:
        kernel.shutdown()
    assert cell.error is None, cell.error
    assert cell.result == "'trained after 2 restarts'"
    assert cell.stderr.splitlines() == [
        "notebook_launcher: restart 1 of 3: rank 1 failed with ValueError: loss is nan",
        "notebook_launcher: restart 2 of 3: rank 1 failed with ValueError: loss is nan",
    ]


def test_a_restart_with_a_fixed_port_binds_it_again(tmp_path, capfd, leak_check):
    port = free_port()
    marker = tmp_path / "failed"

    def fail_once():
        import torch.distributed as dist

        dist.init_process_group("gloo")  # connects to the store on the fixed port
        if os.environ["RANK"] == "1" and not marker.exists():
            marker.write_text("")
            raise RuntimeError("first attempt")
        dist.barrier()
        return os.environ["MASTER_PORT"]

    assert notebook_launcher(fail_once, num_processes=2, use_port=port, max_restarts=1) == str(port)
    assert (
        "restart 1 of 1: rank 1 failed with RuntimeError: first attempt" in capfd.readouterr().err
    )


def test_a_crash_without_exception_is_also_childfailederror(leak_check):
    def crash():
        os._exit(3)

    with pytest.raises(ChildFailedError, match=r"Rank \d \(pid \d+\) exited with code 3") as caught:
        notebook_launcher(crash, num_processes=2, start_method="fork")
    assert type(caught.value).__name__ == "RankFailedError"
    assert caught.value.get_first_failure()[1].exitcode == 3


class Sealed(Exception):
    def __init_subclass__(cls, **kwargs):
        raise TypeError("Sealed cannot be subclassed")


def test_an_exception_type_that_cannot_be_subclassed_still_gives_childfailederror():
    from notebook_launcher.errors import rank_failed_error_class

    cls = rank_failed_error_class(Sealed)
    assert issubclass(cls, RankFailedError) and issubclass(cls, ChildFailedError)
    assert not issubclass(cls, Sealed)
