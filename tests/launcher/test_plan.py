"""Resolving a call into a plan: a pure function of the call, the defaults, the hardware
and the kernel's state, with each refused value blamed on where it came from."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from notebook_launcher import defaults as d
from notebook_launcher.errors import (
    LaunchConfigError,
    LaunchTypeError,
)
from notebook_launcher.hardware import GpuInfo, HardwareReport
from notebook_launcher.launcher.plan import LaunchCall, resolve_plan
from notebook_launcher.launcher.start_method import KernelState

CPU = HardwareReport(
    cpu_count=2,
    gpus=(),
    driver_version=None,
    tpu_cores=0,
    mps_available=False,
    platform="local",
    python_version="3.11",
    torch_version="2.13.0",
    torch_xla_version=None,
)
T4 = dataclasses.replace(CPU, gpus=(GpuInfo(0, "Tesla T4", 15360, "7.5"),))
CLEAN = KernelState()
PATH = Path("/config/notebook_launcher/defaults.json")


def layered(
    kernel: dict[str, object] | None = None, file: dict[str, object] | None = None
) -> d.EffectiveDefaults:
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for layer, source in ((file or {}, d.FILE), (kernel or {}, d.KERNEL)):
        for key, value in layer.items():
            values[key], sources[key] = value, source
    return d.EffectiveDefaults(d.LaunchDefaults(**values), sources, PATH)  # type: ignore[arg-type]


NONE = layered()


def resolve(
    defaults: d.EffectiveDefaults = NONE,
    report: HardwareReport = CPU,
    kernel: KernelState = CLEAN,
    **call: object,
):
    return resolve_plan(LaunchCall(**call), defaults, report, kernel)


def test_a_plain_call_on_a_cpu_machine() -> None:
    plan = resolve()
    assert (plan.backend, plan.num_processes, plan.accelerator, plan.mixed_precision) == (
        "local",
        2,
        "cpu",
        "no",
    )
    assert plan.start.method == "fork" and plan.world_size == 2 and plan.global_rank(1) == 1
    assert plan.keep_result_devices is False and plan.threads_per_rank == 1


def test_defaults_fill_what_the_call_leaves_out_and_the_call_wins() -> None:
    defaults = layered(
        kernel={"num_processes": 1}, file={"mixed_precision": "bf16", "num_processes": 2}
    )
    plan = resolve(defaults)
    assert (plan.num_processes, plan.mixed_precision) == (1, "bf16")
    assert resolve(defaults, num_processes=2, mixed_precision="no").mixed_precision == "no"


def test_a_value_given_in_the_call_is_never_blamed_on_the_defaults() -> None:
    defaults = layered(file={"mixed_precision": "bf16"})
    with pytest.raises(LaunchConfigError) as caught:
        resolve(defaults, num_processes=0)
    assert str(caught.value) == "num_processes must be at least 1; got 0."


def test_a_refused_value_from_the_file_names_the_file() -> None:
    with pytest.raises(LaunchConfigError) as caught:
        resolve(layered(file={"mixed_precision": "bf16"}), report=T4, hardware="cuda")
    assert str(caught.value).endswith(
        f"Tesla T4 is older. The value came from your saved launch defaults ({PATH}): pass the "
        "argument explicitly, or change the defaults in the JupyterLab sidebar or configure()."
    )


def test_a_refused_value_from_configure_names_configure() -> None:
    with pytest.raises(LaunchConfigError) as caught:
        resolve(
            layered(kernel={"start_method": "fork"}, file={"start_method": "spawn"}),
            kernel=KernelState(cuda_initialized=True),
        )
    assert str(caught.value).startswith("start_method='fork' cannot be used: CUDA was initialised")
    assert str(caught.value).endswith(
        "The value came from configure() in this kernel: pass the argument explicitly, or "
        "choose another value in configure()."
    )


def test_a_cpu_rank_count_past_the_limit_is_refused_up_front() -> None:
    for value in (10**6, 10**30):
        with pytest.raises(
            LaunchConfigError,
            match=rf"^num_processes={value} is more CPU ranks than this machine can run: at most \d+ \(",
        ):
            resolve(num_processes=value)
    with pytest.raises(
        LaunchConfigError,
        match=r"Use num_processes<=\d+\. The value came from your saved launch defaults",
    ):
        resolve(layered(file={"num_processes": 10**9}))


@pytest.mark.parametrize(
    ("argument", "value", "error", "message"),
    [
        (
            "timeout",
            "10",
            LaunchTypeError,
            "timeout must be a number of seconds; got str '10'. Pass e.g. timeout=600, or leave it None for no limit.",
        ),
        (
            "timeout",
            -1,
            LaunchConfigError,
            "timeout must be a positive number of seconds; got -1. Pass e.g. timeout=600, or leave it None for no limit.",
        ),
        (
            "timeout",
            float("nan"),
            LaunchConfigError,
            "timeout must be a positive number of seconds; got nan. Pass e.g. timeout=600, or leave it None for no limit.",
        ),
        ("return_all", "yes", LaunchTypeError, "return_all must be True or False; got str 'yes'."),
        (
            "keep_result_devices",
            None,
            LaunchTypeError,
            "keep_result_devices must be True or False; got NoneType None.",
        ),
        (
            "backend",
            "slurm",
            LaunchConfigError,
            "backend='slurm' is not known; use one of 'auto', 'local', 'xla', 'ray' ('auto' picks by the hardware).",
        ),
        (
            "master_addr",
            "",
            LaunchTypeError,
            "master_addr must be a host name or IP address such as '127.0.0.1'; got ''.",
        ),
    ],
)
def test_bad_values_say_what_to_pass(
    argument: str, value: object, error: type, message: str
) -> None:
    with pytest.raises(error) as caught:
        resolve(**{argument: value})
    assert str(caught.value) == message


def test_choices_are_spelled_as_the_server_accepts_them() -> None:
    plan = resolve(mixed_precision="BF16", start_method="Spawn", output="MAIN", hardware="CPU")
    assert (plan.mixed_precision, plan.start.method, plan.output, plan.accelerator) == (
        "bf16",
        "spawn",
        "main",
        "cpu",
    )


LOADED_BY_AN_IMPORT = """
import sys
from notebook_launcher.launcher.start_method import library_loaded
before = library_loaded("libsqlite3.so.0")
import sqlite3  # its extension module loads the library by the loader's search
with open("/proc/self/maps") as maps:
    mapped = "/libsqlite3.so.0" in maps.read()
print(before, library_loaded("libsqlite3.so.0"), mapped, library_loaded("libsqlite3.so.0"))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux loader and /proc")
def test_the_loader_is_asked_for_a_library_by_its_soname_without_loading_it() -> None:
    # As the CUDA driver would be: loaded by a library, under a path of its own.
    seen = subprocess.run(
        [sys.executable, "-c", LOADED_BY_AN_IMPORT], capture_output=True, text=True, check=True
    ).stdout.split()
    if seen[2] != "True":
        pytest.skip("this Python's sqlite3 does not load a shared libsqlite3")
    assert seen == ["False", "True", "True", "True"]


def test_auto_takes_the_forkserver_when_a_library_loaded_the_cuda_driver() -> None:
    kernel = KernelState.detect(
        platform="linux",
        available=["fork", "spawn", "forkserver"],
        is_loaded=lambda soname: soname == "libcuda.so.1",
    )
    assert kernel.cuda_driver_loaded and not kernel.cuda_initialized
    plan = resolve(kernel=kernel)
    assert plan.start.method == "forkserver"
    assert plan.start.fallback_reason.startswith(
        "the CUDA driver was initialised in this kernel (libcuda is loaded: "
    )
    clean = KernelState.detect(
        platform="linux", available=["fork", "spawn", "forkserver"], is_loaded=lambda _: False
    )
    assert resolve(kernel=clean).start.method == "fork"


def test_no_message_ends_a_sentence_twice() -> None:
    bad_calls = [
        {"num_processes": 0},
        {"num_processes": 10**6},
        {"mixed_precision": "fp8"},
        {"timeout": -1},
        {"timeout": "10"},
        {"use_port": "http"},
        {"output": "loud"},
        {"hardware": "gpu"},
        {"start_method": "thread"},
        {"num_nodes": 0},
        {"max_restarts": -1},
        {"backend": "x"},
    ]
    for call in bad_calls:
        with pytest.raises(LaunchConfigError) as caught:
            resolve(
                layered(file={"mixed_precision": "fp8"})
                if call == {"mixed_precision": "fp8"}
                else NONE,
                **call,
            )
        text = str(caught.value)
        assert not re.search(r"\.[.;,]|;\.", text.replace("...", "")), text
