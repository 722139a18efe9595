from __future__ import annotations

import sys

import pytest

from notebook_launcher import hardware

H100 = ("NVIDIA H100 80GB HBM3", 81559, "9.0")
T4 = ("Tesla T4", 15360, "7.5")


def test_gpus_are_read_from_nvidia_smi_without_touching_cuda(fake_gpus):
    fake_gpus(H100, H100)
    report = hardware.detect()
    assert [g.name for g in report.gpus] == [H100[0], H100[0]]
    assert report.gpus[1].index == 1 and report.gpus[0].memory_mib == 81559
    assert report.driver_version == "550.54"
    assert report.accelerator == "cuda" and report.default_num_processes == 2
    if "torch" in sys.modules:
        assert not sys.modules["torch"].cuda.is_initialized()


def test_cuda_visible_devices_narrows_and_renumbers(fake_gpus, monkeypatch):
    fake_gpus(T4, H100, H100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    report = hardware.detect(refresh=True)
    assert [(g.index, g.name) for g in report.gpus] == [(0, H100[0]), (1, H100[0])]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert hardware.detect(refresh=True).gpus == ()


def test_no_nvidia_smi_means_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    report = hardware.detect(refresh=True)
    try:
        assert report.gpus == () and report.accelerator == "cpu"
        assert report.default_num_processes == min(2, report.cpu_count)
    finally:
        monkeypatch.undo()
        hardware.detect(refresh=True)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"COLAB_RELEASE_TAG": "release-colab_20261101"}, "colab"),
        ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, "kaggle"),
        ({"TPU_ACCELERATOR_TYPE": "v4-8"}, "tpu-vm"),
        ({}, "local"),
    ],
)
def test_notebook_platforms_are_recognised_from_their_environment(environ, expected):
    assert hardware.detect_platform(environ) == expected


def test_precision_support_explains_what_cannot_run():
    cpu = hardware.detect()
    support = hardware.precision_support(cpu, "cpu")
    assert support["no"] is None and support["bf16"] is None
    assert support["fp16"] is None  # torch runs fp16 autocast and gradient scaling on CPU
    assert "fp8 needs a Hopper-class NVIDIA GPU" in support["fp8"]


def test_fp8_needs_hopper_and_bf16_needs_ampere(fake_gpus):
    fake_gpus(T4)
    support = hardware.precision_support(hardware.detect())
    assert "bf16 needs an Ampere or newer GPU" in support["bf16"]
    assert "Tesla T4 has none" in support["fp8"]
    fake_gpus(H100)
    assert set(hardware.precision_support(hardware.detect()).values()) == {None}


def test_the_report_is_plain_json_data(fake_gpus):
    import json

    fake_gpus(H100)
    data = json.loads(json.dumps(hardware.detect().to_dict()))
    assert data["gpus"][0]["compute_capability"] == "9.0"
    assert data["precisions"]["fp8"] is None
