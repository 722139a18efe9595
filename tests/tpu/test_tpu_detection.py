from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from notebook_launcher import hardware
from notebook_launcher.tpu import detect_tpu, parse_accelerator_type
from tests.support.tpu import FAKE_XLA, MACHINES, build_root

# name: (generation, chips, cores, processes, platform)
EXPECTED = {
    "colab-v2-8": ("v2", 4, 8, 4, "colab"),
    "kaggle-v3-8": ("v3", 4, 8, 4, "kaggle"),
    "kaggle-v5e-8": ("v5e", 8, 8, 8, "kaggle"),
    "colab-v5e-1": ("v5e", 1, 1, 1, "colab"),
    "colab-v6e-1": ("v6e", 1, 1, 1, "colab"),
    "tpu-vm-v4-8": ("v4", 4, 4, 4, "tpu-vm"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_runtime_is_recognised_from_its_devices_and_variables(name, tmp_path):
    machine = MACHINES[name]
    tpu = detect_tpu(machine.environ, build_root(tmp_path, machine))
    generation, chips, cores, processes, platform = EXPECTED[name]
    assert tpu is not None
    assert (tpu.generation, tpu.chips, tpu.cores, tpu.processes) == (
        generation,
        chips,
        cores,
        processes,
    )
    assert tpu.pjrt_device == "TPU" and tpu.hosts == 1
    assert hardware.detect_platform(machine.environ) == platform
    assert f"{chips} TPU chip(s) on the PCI bus" in tpu.evidence


def test_v2_and_v3_chips_run_two_device_threads_per_process(tmp_path):
    tpu = detect_tpu(MACHINES["colab-v2-8"].environ, build_root(tmp_path, MACHINES["colab-v2-8"]))
    assert tpu is not None and tpu.cores_per_chip == 2
    assert (
        tpu.describe() == "TPU v2-8: 4 chip(s), 8 core(s), 4 process(es) of 2 device threads each"
    )


def test_the_report_line_of_kaggles_v5e_8():
    tpu = detect_tpu({"TPU_ACCELERATOR_TYPE": "v5litepod-8", "PJRT_DEVICE": "TPU"}, "/nonexistent")
    assert tpu is not None
    assert tpu.describe() == "TPU v5litepod-8: 8 chip(s), 8 core(s), 8 process(es)"


def test_the_chips_on_the_bus_win_over_the_accelerator_type(tmp_path):
    # A VM whose type names a slice larger than what is attached counts what is attached.
    machine = MACHINES["colab-v5e-1"]
    tpu = detect_tpu(
        {**machine.environ, "TPU_ACCELERATOR_TYPE": "v5litepod-8"}, build_root(tmp_path, machine)
    )
    assert tpu is not None and tpu.chips == 1 and tpu.processes == 1


def test_pci_devices_alone_reveal_the_tpu_and_its_generation(tmp_path):
    tpu = detect_tpu({}, build_root(tmp_path, MACHINES["kaggle-v5e-8"]))
    assert tpu is not None and (tpu.generation, tpu.chips, tpu.accelerator_type) == ("v5e", 8, "")


def test_v2_and_v3_share_a_pci_id_so_without_the_type_the_generation_is_unknown(tmp_path):
    tpu = detect_tpu({}, build_root(tmp_path, MACHINES["kaggle-v3-8"]))
    assert tpu is not None and tpu.generation == "" and tpu.cores_per_chip == 2 and tpu.cores == 8


def test_the_runtime_variables_alone_are_enough_inside_a_container_without_sys(tmp_path):
    tpu = detect_tpu({"TPU_ACCELERATOR_TYPE": "v3-8"}, tmp_path)
    assert tpu is not None and (tpu.chips, tpu.cores, tpu.processes) == (4, 8, 4)


def test_vfio_devices_without_any_tpu_sign_are_not_a_tpu(tmp_path):
    machine = MACHINES["colab-v5e-1"]
    root = build_root(tmp_path, machine)
    for pci in (root / "sys/bus/pci/devices").iterdir():
        (pci / "vendor").write_text("0x10de\n")  # an NVIDIA GPU passed through with VFIO
    assert detect_tpu({}, root) is None


def test_tpu_process_bounds_narrow_the_processes_as_torch_xla_does(tmp_path):
    machine = MACHINES["kaggle-v5e-8"]
    environ = {**machine.environ, "TPU_PROCESS_BOUNDS": "1,1,1"}
    tpu = detect_tpu(environ, build_root(tmp_path, machine))
    assert tpu is not None and tpu.chips == 8 and tpu.processes == 1


def test_a_slice_of_several_hosts_counts_this_hosts_chips():
    assert parse_accelerator_type("v4-32") == ("v4", 4, 4)
    assert parse_accelerator_type("v5litepod-16") == ("v5e", 4, 4)
    assert parse_accelerator_type("v6e-8") == ("v6e", 8, 1)
    assert parse_accelerator_type("v2-8") == ("v2", 4, 1)
    assert parse_accelerator_type("not a type") == ("", 0, 1)


@pytest.mark.parametrize(
    ("variable", "value", "hosts"),
    [
        ("TPU_WORKER_HOSTNAMES", "t1v-n-0,t1v-n-1", 2),
        ("TPU_WORKER_HOSTNAMES", "localhost", 1),
        ("TPU_HOST_BOUNDS", "2,2,1", 4),
        ("TPU_HOST_BOUNDS", "1,1,1", 1),
    ],
)
def test_the_hosts_of_a_slice_are_read_from_every_variable_torch_xla_reads(
    tmp_path, variable, value, hosts
):
    machine = MACHINES["tpu-vm-v4-8"]
    tpu = detect_tpu(
        {**machine.environ, "PJRT_DEVICE": "TPU", variable: value}, build_root(tmp_path, machine)
    )
    assert tpu is not None and tpu.hosts == hosts and tpu.chips == 4


def test_no_tpu_on_a_plain_machine(tmp_path):
    assert detect_tpu({}, tmp_path) is None


def test_another_pjrt_device_is_not_a_tpu(tmp_path):
    machine = MACHINES["kaggle-v5e-8"]
    assert detect_tpu({"PJRT_DEVICE": "CUDA"}, build_root(tmp_path, machine)) is None


def test_xla_on_the_cpu_is_reported_without_tpu_cores(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(FAKE_XLA)
    tpu = detect_tpu({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}, tmp_path)
    assert tpu is not None and tpu.pjrt_device == "CPU" and tpu.processes == 1 and tpu.cores == 2
    assert tpu.describe() == "XLA on CPU (PJRT_DEVICE=CPU): 1 process, 2 device(s)"
    assert "torch_xla" not in sys.modules  # found, never imported


def test_the_hardware_report_carries_the_tpu_and_stays_plain_json(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi
    try:
        report = hardware.detect(refresh=True)
        assert report.accelerator == "tpu" and report.tpu_cores == 8
        data = json.loads(json.dumps(report.to_dict()))
        assert data["tpu"]["generation"] == "v5e" and data["tpu"]["processes"] == 8
    finally:
        monkeypatch.undo()
        hardware.detect(refresh=True)


def test_detection_never_imports_torch_xla():
    # In a fresh interpreter where the (fake) torch_xla is installed.
    import notebook_launcher

    package_root = Path(notebook_launcher.__file__).parents[1]
    code = (
        "import sys; from notebook_launcher import hardware; r = hardware.detect();"
        "print(r.tpu.describe(), 'torch_xla' in sys.modules)"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{FAKE_XLA}:{package_root}",
        "PJRT_DEVICE": "TPU",
        "TPU_ACCELERATOR_TYPE": "v6e-1",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "TPU v6e-1: 1 chip(s), 1 core(s), 1 process(es) False", out.stderr


def test_the_report_says_in_one_line_what_a_tpu_launch_starts(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v3-8")
    try:
        data = hardware.detect(refresh=True).to_dict()
        assert (
            data["tpu_summary"]
            == "TPU v3-8: 4 chip(s), 8 core(s), 4 process(es) of 2 device threads each"
        )
        assert data["default_num_processes"] == 4 and data["max_num_processes"] == 4
    finally:
        monkeypatch.undo()
        hardware.detect(refresh=True)
