"""Who a process is and where it computes, read from the environment contract."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from notebook_launcher import hardware
from notebook_launcher.accelerator import Accelerator, DistributedType, RankEnvironmentError
from notebook_launcher.accelerator.rank_state import (
    RankState,
    choose_device_kind,
    device_for,
    init_process_group_if_needed,
    read_rank_numbers,
)
from tests.support.accelerator import plain_process  # noqa: F401

pytestmark = pytest.mark.usefixtures("plain_process")


def fake_report(
    gpus: tuple[hardware.GpuInfo, ...] = (), tpu_cores: int = 0
) -> hardware.HardwareReport:
    return hardware.HardwareReport(
        cpu_count=2,
        gpus=gpus,
        driver_version="550" if gpus else None,
        tpu_cores=tpu_cores,
        mps_available=False,
        platform="local",
        python_version="3.11",
        torch_version="2.13.0",
        torch_xla_version=None,
    )


H100 = hardware.GpuInfo(0, "NVIDIA H100 80GB HBM3", 81559, "9.0")


def no_detection() -> hardware.HardwareReport:
    raise AssertionError("hardware detection ran although the environment decided the device")


def test_explicit_cpu_wins_over_the_launchers_gpu_placement() -> None:
    kind = choose_device_kind(
        cpu=True,
        environ={"NOTEBOOK_LAUNCHER_ACCELERATOR": "cuda"},
        detect_hardware=no_detection,
        cuda_built=True,
    )
    assert kind == "cpu"


@pytest.mark.parametrize("placed", ["cuda", "cpu", "tpu", "mps"])
def test_the_launchers_placement_is_used_without_detecting_hardware(placed: str) -> None:
    kind = choose_device_kind(
        cpu=False,
        environ={"NOTEBOOK_LAUNCHER_ACCELERATOR": placed},
        detect_hardware=no_detection,
        cuda_built=True,
    )
    assert kind == placed


def test_accelerate_use_cpu_selects_the_cpu_without_detecting_hardware() -> None:
    kind = choose_device_kind(
        cpu=False,
        environ={"ACCELERATE_USE_CPU": "true"},
        detect_hardware=no_detection,
        cuda_built=True,
    )
    assert kind == "cpu"


def test_without_launcher_variables_the_detected_gpu_is_used() -> None:
    kind = choose_device_kind(
        cpu=False, environ={}, detect_hardware=lambda: fake_report((H100,)), cuda_built=True
    )
    assert kind == "cuda"


def test_a_gpu_with_a_cpu_only_torch_build_warns_and_uses_the_cpu() -> None:
    with pytest.warns(
        UserWarning,
        match=r"has an NVIDIA GPU but torch .* has no CUDA support, so training runs on the CPU",
    ):
        kind = choose_device_kind(
            cpu=False, environ={}, detect_hardware=lambda: fake_report((H100,)), cuda_built=False
        )
    assert kind == "cpu"


def test_tpu_cores_are_used_when_detected() -> None:
    kind = choose_device_kind(
        cpu=False, environ={}, detect_hardware=lambda: fake_report(tpu_cores=8), cuda_built=False
    )
    assert kind == "tpu"


def test_an_unknown_launcher_placement_is_an_error() -> None:
    with pytest.raises(
        RankEnvironmentError,
        match=r"NOTEBOOK_LAUNCHER_ACCELERATOR='gpu' is not a device kind this core knows \(cuda, cpu, tpu, mps\)",
    ):
        choose_device_kind(
            cpu=False,
            environ={"NOTEBOOK_LAUNCHER_ACCELERATOR": "gpu"},
            detect_hardware=no_detection,
            cuda_built=True,
        )


def test_a_gpu_placement_with_a_cpu_only_torch_build_is_an_error() -> None:
    with pytest.raises(
        RankEnvironmentError, match=r"placed on a CUDA GPU but torch .* is a build without CUDA"
    ):
        choose_device_kind(
            cpu=False,
            environ={"NOTEBOOK_LAUNCHER_ACCELERATOR": "cuda"},
            detect_hardware=no_detection,
            cuda_built=False,
        )


def test_the_cuda_device_is_the_local_rank_and_choosing_it_does_not_start_cuda() -> None:
    assert device_for("cuda", 3) == torch.device("cuda", 3)
    assert not torch.cuda.is_initialized()


def test_a_plain_process_is_rank_0_of_1() -> None:
    assert read_rank_numbers({}) == (0, 0, 1, 1)


def test_torchrun_variables_give_rank_and_world_size() -> None:
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert read_rank_numbers(env) == (5, 1, 8, 4)


def test_a_malformed_rank_variable_is_an_error() -> None:
    with pytest.raises(RankEnvironmentError, match=r"WORLD_SIZE='two' is not an integer"):
        read_rank_numbers({"WORLD_SIZE": "two", "RANK": "0"})


def test_a_rank_outside_the_world_is_an_error() -> None:
    with pytest.raises(RankEnvironmentError, match=r"RANK=2 and WORLD_SIZE=2 are inconsistent"):
        read_rank_numbers({"WORLD_SIZE": "2", "RANK": "2"})


def test_a_world_size_without_rank_is_an_error() -> None:
    with pytest.raises(RankEnvironmentError, match=r"WORLD_SIZE=2 but RANK is not set"):
        read_rank_numbers({"WORLD_SIZE": "2"})


def test_several_ranks_without_a_master_address_is_an_error() -> None:
    state = RankState(
        rank=1,
        local_rank=1,
        world_size=2,
        local_world_size=2,
        device_kind="cpu",
        device=torch.device("cpu"),
    )
    with pytest.raises(
        RankEnvironmentError,
        match=r"WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT not set, so rank 1 cannot find the others",
    ):
        init_process_group_if_needed(state, environ={"WORLD_SIZE": "2", "RANK": "1"})
    assert not dist.is_initialized()


def test_one_plain_process_needs_no_process_group() -> None:
    accelerator = Accelerator()
    assert not dist.is_initialized()
    assert accelerator.num_processes == 1
    assert accelerator.process_index == 0 and accelerator.local_process_index == 0
    assert accelerator.is_main_process and accelerator.is_local_main_process
    assert accelerator.distributed_type == DistributedType.NO == "NO"
    assert accelerator.device == torch.device("cpu")
    assert accelerator.mixed_precision == "no"
    assert not accelerator.use_distributed
    assert "num_processes=1" in repr(accelerator)


def test_accelerator_takes_the_launchers_choices_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NOTEBOOK_LAUNCHER_ACCELERATOR", "cpu")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert Accelerator().mixed_precision == "bf16"
    assert Accelerator(mixed_precision="no").mixed_precision == "no"  # explicit wins


def test_creating_an_accelerator_never_starts_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.cuda was touched while only choosing the device")

    monkeypatch.setattr(torch.cuda, "is_available", forbidden)
    monkeypatch.setattr(torch.cuda, "init", forbidden)
    monkeypatch.setattr(torch.cuda, "device_count", forbidden)
    Accelerator()
    assert not torch.cuda.is_initialized()
