"""The GPU guards before a launch, with the detection faked (nvidia-smi, torch's arch list,
the peer-access probe, /dev/shm); the logic runs as it does on a GPU machine."""

from __future__ import annotations

import pytest

from notebook_launcher import gpu_guards
from notebook_launcher.errors import LaunchConfigError
from notebook_launcher.launcher import launch
from notebook_launcher.launcher.plan import LaunchCall

CU128 = ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
CU124 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


def work() -> None:
    pass


@pytest.mark.parametrize(
    ("capability", "arch_list", "runs"),
    [
        ("7.5", CU128, True),  # T4
        ("8.9", CU128, True),  # L4: sm_86 binaries run on 8.9
        ("6.0", CU128, False),  # P100 under a cu128 build
        ("12.0", CU124, False),  # Blackwell under a build without sm_120
        ("12.0", ["sm_80", "compute_90"], True),  # PTX for an older architecture is compiled
        ("9.0", ["sm_90a"], True),
        ("", CU128, True),  # the driver did not say: never refused on a guess
    ],
)
def test_a_gpu_runs_a_torch_build_with_kernels_for_its_architecture(capability, arch_list, runs):
    assert gpu_guards.arch_supported(capability, arch_list) is runs


def test_a_p100_under_a_torch_without_sm_60_is_refused_before_the_launch(fake_gpus, monkeypatch):
    fake_gpus(("Tesla P100-PCIE-16GB", 16384, "6.0"), ("Tesla P100-PCIE-16GB", 16384, "6.0"))
    monkeypatch.setattr(gpu_guards, "torch_arch_list", lambda: list(CU128))
    started = []
    monkeypatch.setattr(gpu_guards, "probe_peer_access", lambda visible: started.append(1))
    with pytest.raises(LaunchConfigError) as caught:
        launch.prepare(work, (), None, LaunchCall(hardware="cuda"))
    assert str(caught.value).startswith(
        "GPU 0 (Tesla P100-PCIE-16GB, compute capability 6.0), GPU 1 (Tesla P100-PCIE-16GB, "
        "compute capability 6.0): the installed torch "
    )
    assert (
        "was built for sm_70 sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 and has no kernels for sm_60, "
        in str(caught.value)
    )
    assert '"no kernel image is available for execution on the device"' in str(caught.value)
    assert "Install a torch build that still has kernels for it" in str(caught.value)
    assert not started  # refused before anything was probed or started


def test_a_blackwell_gpu_under_an_older_torch_is_told_to_take_a_newer_cuda_build(
    fake_gpus, monkeypatch
):
    fake_gpus(("NVIDIA RTX PRO 6000 Blackwell", 97887, "12.0"))
    monkeypatch.setattr(gpu_guards, "torch_arch_list", lambda: list(CU124))
    with pytest.raises(
        LaunchConfigError, match=r"no kernels for sm_120.*cu128 or later for sm_120"
    ):
        launch.prepare(work, (), None, LaunchCall(hardware="cuda", num_processes=1))


def test_broken_peer_access_and_a_small_shm_set_nccl_variables_with_one_line_each(
    fake_gpus, monkeypatch, capsys
):
    fake_gpus(("Tesla T4", 15360, "7.5"), ("Tesla T4", 15360, "7.5"))
    monkeypatch.setattr(gpu_guards, "torch_arch_list", lambda: list(CU128))
    monkeypatch.setattr(gpu_guards, "probe_peer_access", lambda visible: ((0, 1), (1, 0)))
    monkeypatch.setattr(gpu_guards, "shm_size", lambda: 64 * 2**20)  # Docker's default
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    monkeypatch.delenv("NCCL_SHM_DISABLE", raising=False)
    prepared = launch.prepare(work, (), None, LaunchCall(hardware="cuda"))
    assert dict(prepared.plan.rank_environ) == {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "notebook_launcher: peer-to-peer access between GPUs failed its probe (0->1, 1->0), "
        "where NCCL would hang: NCCL_P2P_DISABLE=1 is set in the ranks (NCCL goes through host "
        "memory instead).",
        "notebook_launcher: /dev/shm holds 64 MB, too small for NCCL's shared memory (it needs "
        "about 512 MB): NCCL_SHM_DISABLE=1 is set in the ranks. A bigger /dev/shm (docker run "
        "--shm-size=1g) is faster.",
    ]


def test_working_peer_access_and_a_big_shm_set_nothing_and_say_nothing(
    fake_gpus, monkeypatch, capsys
):
    fake_gpus(("NVIDIA H100", 81559, "9.0"), ("NVIDIA H100", 81559, "9.0"))
    monkeypatch.setattr(gpu_guards, "torch_arch_list", lambda: list(CU128))
    monkeypatch.setattr(gpu_guards, "probe_peer_access", lambda visible: ())
    monkeypatch.setattr(gpu_guards, "shm_size", lambda: 32 * 2**30)
    prepared = launch.prepare(work, (), None, LaunchCall(hardware="cuda"))
    assert dict(prepared.plan.rank_environ) == {}
    assert capsys.readouterr().err == ""


def test_a_variable_the_user_set_is_left_alone():
    settings = gpu_guards.nccl_settings(
        2, {"NCCL_P2P_DISABLE": "0", "NCCL_SHM_DISABLE": "0"}, [(0, 1)], 1
    )
    assert settings.environ == {} and settings.lines == ()


def test_one_gpu_needs_no_nccl_settings():
    assert gpu_guards.nccl_settings(1, {}, [(0, 1)], 1).environ == {}


def test_the_probe_runs_in_a_subprocess_and_an_unrunnable_probe_says_nothing(monkeypatch):
    # No GPU here: the subprocess finds none, so no pair failed; nothing started in this process.
    import sys

    gpu_guards.probe_peer_access.cache_clear()
    assert gpu_guards.probe_peer_access(None) == ()
    assert "torch.cuda" not in sys.modules or not __import__("torch").cuda.is_initialized()
    gpu_guards.probe_peer_access.cache_clear()
    monkeypatch.setattr(gpu_guards, "_PROBE", "print('not json')")
    assert gpu_guards.probe_peer_access(None) is None
    gpu_guards.probe_peer_access.cache_clear()


def test_shm_is_measured():
    size = gpu_guards.shm_size()
    assert size is None or size > 0
    assert gpu_guards.shm_size("/no/such/dir") is None


def test_the_configure_panel_greys_out_a_gpu_torch_has_no_kernels_for(fake_gpus, monkeypatch):
    from notebook_launcher import hardware
    from notebook_launcher.widgets.panel import hardware_html

    fake_gpus(("Tesla P100-PCIE-16GB", 16384, "6.0"), ("Tesla T4", 15360, "7.5"))
    monkeypatch.setattr(gpu_guards, "torch_arch_list", lambda: list(CU128))
    shown = hardware_html(hardware.detect())
    assert (
        '<span class="nl-gpu-unusable" style="opacity: 0.45;"><b>GPU 0</b>: Tesla P100-PCIE-16GB, '
        "16 GiB, compute capability 6.0: the installed torch has no kernels for it</span>"
    ) in shown
    assert "<b>GPU 1</b>: Tesla T4, 15 GiB, compute capability 7.5<" in shown
