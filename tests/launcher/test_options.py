"""Every bad input is refused before any process starts, with a message naming the fix."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from notebook_launcher import LaunchConfigError, notebook_launcher
from notebook_launcher.errors import LaunchTypeError

H100 = ("NVIDIA H100 80GB HBM3", 81559, "9.0")


def never_called():  # pragma: no cover - the launch must be refused first
    raise AssertionError("a rank started")


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, LaunchConfigError, r"num_processes must be at least 1; got 0\."),
        (-2, LaunchConfigError, r"num_processes must be at least 1; got -2\."),
        ("2", LaunchTypeError, r"num_processes must be a whole number of ranks; got str '2'"),
        (1.5, LaunchTypeError, r"num_processes must be a whole number of ranks; got float 1\.5"),
        (True, LaunchTypeError, r"got bool True"),
    ],
)
def test_bad_num_processes(value, error, message, leak_check):
    with pytest.raises(error, match=message):
        notebook_launcher(never_called, num_processes=value)


def test_more_ranks_than_gpus(fake_gpus):
    fake_gpus(H100, H100)
    with pytest.raises(
        LaunchConfigError,
        match=r"num_processes=3 but this machine has 2 GPU\(s\) \(NVIDIA H100 80GB HBM3, NVIDIA H100 80GB HBM3\); "
        r"each rank needs its own GPU\. Use num_processes<=2, or hardware='cpu'",
    ):
        notebook_launcher(never_called, num_processes=3)


def test_unknown_mixed_precision(leak_check):
    with pytest.raises(
        LaunchConfigError,
        match=r"mixed_precision='bf32' is not known; use one of 'no', 'fp16', 'bf16', 'fp8'\.",
    ):
        notebook_launcher(never_called, mixed_precision="bf32")


def test_precision_the_hardware_cannot_run(leak_check):
    with pytest.raises(
        LaunchConfigError, match=r"mixed_precision='fp8' cannot run here: fp8 needs a Hopper"
    ):
        notebook_launcher(never_called, mixed_precision="fp8", hardware="cpu")


def test_unknown_start_method(leak_check):
    with pytest.raises(LaunchConfigError, match=r"start_method='threads' is not a start method"):
        notebook_launcher(never_called, start_method="threads")


def test_port_in_use(leak_check):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(
            LaunchConfigError,
            match=rf"use_port={port}: port {port} on 127\.0\.0\.1 is already in use by another process\. "
            "Leave use_port unset",
        ):
            notebook_launcher(never_called, use_port=port)


@pytest.mark.parametrize("port", ["http", 0, 70000, -1])
def test_port_that_is_not_a_port(port, leak_check):
    with pytest.raises(LaunchConfigError, match=rf"use_port={port!r} is not a TCP port"):
        notebook_launcher(never_called, use_port=port)


def test_function_not_callable(leak_check):
    with pytest.raises(
        LaunchTypeError,
        match=r"function must be callable .*got int 3\. Pass the function itself, not its result",
    ):
        notebook_launcher(3)


def test_args_not_a_tuple(leak_check):
    with pytest.raises(
        LaunchTypeError,
        match=r"args must be a tuple or list of positional arguments; got int 5\. "
        r"For one argument write args=\(5,\) with the trailing comma\.",
    ):
        notebook_launcher(never_called, args=5)


def test_kwargs_not_a_dict(leak_check):
    with pytest.raises(LaunchTypeError, match=r"kwargs must be a dict of keyword arguments"):
        notebook_launcher(never_called, kwargs=[1])


def test_unpicklable_argument_is_named(leak_check):
    lock = threading.Lock()
    with pytest.raises(
        LaunchConfigError,
        match=r"args\[1\] \(a _thread\.lock\) cannot be sent to the ranks: TypeError: cannot pickle "
        r"'_thread\.lock' object\. Ranks started with this start method receive everything by value",
    ):
        notebook_launcher(never_called, args=(1, lock), start_method="spawn")


def test_unpicklable_global_of_the_function_is_named(leak_check):
    def uses_a_lock():
        return GLOBAL_LOCK.locked()

    with pytest.raises(
        LaunchConfigError,
        match=r"function '.*uses_a_lock' uses the global 'GLOBAL_LOCK' \(a _thread\.lock\), which cannot be sent",
    ):
        notebook_launcher(uses_a_lock, start_method="forkserver")


GLOBAL_LOCK = threading.Lock()


def test_unpicklable_closure_variable_is_named(leak_check):
    lock = threading.RLock()

    def uses_a_lock():
        return lock

    with pytest.raises(
        LaunchConfigError, match=r"uses the closure variable 'lock' \(a _thread\.RLock\)"
    ):
        notebook_launcher(uses_a_lock, start_method="spawn")


def test_tpu_is_not_silently_run_on_cpu():
    with pytest.raises(LaunchConfigError, match=r"hardware='tpu' but no TPU was found"):
        notebook_launcher(never_called, hardware="tpu")


def test_cuda_requested_without_a_gpu(monkeypatch, tmp_path):
    from notebook_launcher import hardware

    monkeypatch.setenv("PATH", str(tmp_path))
    hardware.detect(refresh=True)
    try:
        with pytest.raises(LaunchConfigError, match=r"hardware='cuda' but no NVIDIA GPU was found"):
            notebook_launcher(never_called, hardware="cuda")
    finally:
        monkeypatch.undo()
        hardware.detect(refresh=True)


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        (
            "timeout",
            0,
            r"timeout must be a positive number of seconds; got 0\. Pass e\.g\. timeout=600, or leave it None for no limit\.",
        ),
        (
            "monitor_interval",
            "fast",
            r"monitor_interval must be a number of seconds; got str 'fast'\. Pass e\.g\. monitor_interval=0\.1\.",
        ),
        ("output", "loud", r"output='loud' is not an output mode; use 'all'"),
        ("hardware", "gpu", r"hardware='gpu' is not known; use one of 'auto', 'cpu', 'cuda'"),
        ("log_line_prefix_template", 3, r"log_line_prefix_template must be a string"),
    ],
)
def test_other_bad_values(argument, value, message):
    with pytest.raises(LaunchConfigError, match=message):
        notebook_launcher(never_called, **{argument: value})


def test_a_launch_from_inside_a_rank_is_refused(monkeypatch):
    monkeypatch.setenv("NOTEBOOK_LAUNCHER_LAUNCH_ID", "abc")
    with pytest.raises(
        LaunchConfigError,
        match=r"called inside a rank of a running launch; launches cannot be nested",
    ):
        notebook_launcher(never_called)


@pytest.mark.slow(
    reason="scripts launched in processes of their own, with and without saved defaults"
)
def test_saved_defaults_fill_what_the_call_leaves_out(tmp_path, monkeypatch, leak_check):
    from notebook_launcher.defaults import LaunchDefaults, save_defaults

    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path))
    save_defaults(
        LaunchDefaults(num_processes=1, mixed_precision="bf16", start_method="forkserver")
    )
    seen = notebook_launcher(
        lambda: (os.environ["WORLD_SIZE"], os.environ["ACCELERATE_MIXED_PRECISION"])
    )
    assert seen == ("1", "bf16")
    explicit = notebook_launcher(
        lambda: (os.environ["WORLD_SIZE"], os.environ["ACCELERATE_MIXED_PRECISION"]),
        num_processes=2,
        mixed_precision="no",
    )
    assert explicit == ("2", "no")
    monkeypatch.undo()


def test_a_saved_default_the_machine_cannot_run_is_blamed_on_the_defaults(tmp_path, monkeypatch):
    from notebook_launcher.defaults import LaunchDefaults, save_defaults

    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path))
    save_defaults(LaunchDefaults(mixed_precision="fp8"))
    with pytest.raises(
        LaunchConfigError,
        match=r"mixed_precision='fp8' cannot run here: .* The value came from your saved launch "
        r"defaults \(.*defaults\.json\): pass the argument explicitly, or change the defaults",
    ):
        notebook_launcher(never_called)
