"""The one source of every rule, and the parts that must agree with it on every platform."""

from __future__ import annotations

import multiprocessing
import sys

import pytest

from notebook_launcher import defaults as d
from notebook_launcher import rules
from notebook_launcher.errors import LaunchConfigError
from notebook_launcher.hardware import GpuInfo, HardwareReport
from notebook_launcher.launcher.start_method import KernelState, choose_start_method


def report(
    cpu_count: int = 2, gpus: tuple[GpuInfo, ...] = (), tpu_cores: int = 0
) -> HardwareReport:
    return HardwareReport(
        cpu_count=cpu_count,
        gpus=gpus,
        driver_version=None,
        tpu_cores=tpu_cores,
        mps_available=False,
        platform="local",
        python_version="3.11",
        torch_version="2.13.0",
        torch_xla_version=None,
    )


PLATFORMS = [
    ("linux", ["fork", "spawn", "forkserver"]),
    ("darwin", ["spawn", "fork", "forkserver"]),  # macOS lists fork, but it is unsafe there
    ("win32", ["spawn"]),
]


@pytest.mark.parametrize(("platform", "methods"), PLATFORMS)
def test_start_methods_agree_between_rules_launcher_and_defaults(
    platform: str, methods: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    support = rules.start_method_support(platform, methods)
    kernel = KernelState.detect(platform=platform, available=methods, is_loaded=lambda _: False)
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: methods)
    for method, reason in support.items():
        if method == "auto":
            continue
        saved = d.LaunchDefaults(start_method=method)
        if reason is None:
            assert choose_start_method(method, kernel).method == method
            d.check_against_hardware(saved, report())
        else:
            with pytest.raises(LaunchConfigError):
                choose_start_method(method, kernel)
            with pytest.raises(d.DefaultsError, match=r"cannot run here: "):
                d.check_against_hardware(saved, report())
    assert rules.choices(report())["start_method"] == support


def test_fork_is_refused_on_macos_with_the_reason() -> None:
    support = rules.start_method_support("darwin", ["spawn", "fork", "forkserver"])
    assert support["fork"] == (
        "fork is not safe on this platform (darwin): a forked process crashes once system "
        "frameworks are loaded"
    )
    assert support["forkserver"] is None and support["spawn"] is None
    kernel = KernelState.detect(platform="darwin", available=["spawn", "fork", "forkserver"])
    assert choose_start_method("auto", kernel).method == "forkserver"


def test_precisions_refuse_only_what_torch_cannot_run() -> None:
    cpu = rules.precision_support(report(), "cpu")
    assert cpu["no"] is None and cpu["bf16"] is None and cpu["fp16"] is None
    assert cpu["fp8"] == "fp8 needs a Hopper-class NVIDIA GPU; this machine runs ranks on CPU"
    assert rules.precision_support(report(tpu_cores=8), "tpu")["fp16"].startswith(
        "fp16 is not supported on TPU; use bf16"
    )


@pytest.mark.parametrize(("cores", "limit"), [(1, 16), (2, 16), (4, 16), (8, 32), (64, 256)])
def test_cpu_ranks_are_limited_by_the_cores(cores: int, limit: int) -> None:
    assert rules.max_num_processes(report(cores), "cpu", open_files_limit=1 << 20) == limit


def test_cpu_ranks_are_limited_by_the_open_files_limit() -> None:
    assert rules.max_num_processes(report(64), "cpu", open_files_limit=256) == 32
    problem = rules.num_processes_problem(100, report(64), "cpu", open_files_limit=256)
    assert problem == (
        "num_processes=100 is more CPU ranks than this machine can run: at most 32 (the kernel "
        "holds 6 open files per rank and its open-files limit (ulimit -n) is 256). Use fewer "
        "ranks, or raise the limit (ulimit -n) before starting Jupyter"
    )


def test_a_huge_cpu_rank_count_is_refused_with_the_limit_why_and_the_fix() -> None:
    for value in (10**6, 10**30):
        assert rules.num_processes_problem(value, report(2), "cpu", open_files_limit=1024) == (
            f"num_processes={value} is more CPU ranks than this machine can run: at most 16 "
            "(4 per core on its 2 core(s), and never fewer than 16: each CPU rank is a whole "
            "Python process with its own copy of torch, and beyond that ranks only wait for one "
            "another). Use num_processes<=16"
        )
    assert rules.num_processes_problem(16, report(2), "cpu", open_files_limit=1024) is None


def test_device_ranks_are_limited_by_the_devices() -> None:
    two = report(gpus=(GpuInfo(0, "T4", 1, "7.5"), GpuInfo(1, "T4", 1, "7.5")))
    assert rules.max_num_processes(two) == 2 and rules.default_num_processes(two) == 2
    assert rules.max_num_processes(report(tpu_cores=8)) == 8
    assert rules.default_num_processes(report(cpu_count=1)) == 1


def test_the_hardware_report_and_the_choices_say_the_same() -> None:
    machine = report(8)
    data = machine.to_dict()
    offered = rules.choices(machine)
    assert data["default_num_processes"] == offered["num_processes"]["default"] == 2
    assert data["max_num_processes"] == offered["num_processes"]["max"]
    assert data["precisions"] == offered["mixed_precision"]
    assert (
        offered["num_processes"]["note"]
        == f"CPU ranks share the 8 core(s); at most {offered['num_processes']['max']}."
    )


@pytest.mark.parametrize("value", ["BF16", " bf16 ", "Bf16"])
def test_choices_are_spelled_alike_everywhere(value: str) -> None:
    assert rules.canonical(value) == "bf16"
    assert d.parse_defaults({"mixed_precision": value}).mixed_precision == "bf16"
