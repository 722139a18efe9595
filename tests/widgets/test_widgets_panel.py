"""configure(): the panel's choices follow the launcher's rules, and a choice drives launches."""

from __future__ import annotations

import json
import os

import pytest

from notebook_launcher import configure, defaults, notebook_launcher, rules
from notebook_launcher.errors import DefaultsError
from notebook_launcher.hardware import detect
from notebook_launcher.widgets.panel import ConfigurePanel


@pytest.fixture(autouse=True)
def private_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path / "config"))
    defaults.set_kernel_defaults(None)
    yield tmp_path / "config" / "notebook_launcher" / "defaults.json"
    defaults.set_kernel_defaults(None)


@pytest.fixture(autouse=True)
def close_widgets():
    """Close this test's widgets while their comms exist (not at interpreter exit)."""
    yield
    import ipywidgets

    ipywidgets.Widget.close_all()


def world_and_precision():
    return os.environ["WORLD_SIZE"], os.environ["ACCELERATE_MIXED_PRECISION"]


def test_a_choice_from_code_drives_the_next_launches_and_arguments_still_win(leak_check):
    chosen = configure(num_processes=1, mixed_precision="bf16")
    assert chosen == defaults.LaunchDefaults(1, "bf16", None)
    assert notebook_launcher(world_and_precision, dashboard=False) == ("1", "bf16")
    assert notebook_launcher(world_and_precision, num_processes=2, mixed_precision="no",
                             dashboard=False) == ("2", "no")  # fmt: skip
    assert configure(mixed_precision=None) == defaults.LaunchDefaults(
        1, None, None
    )  # back to deciding


def test_this_kernels_choice_wins_over_the_saved_file_field_by_field(private_defaults):
    private_defaults.parent.mkdir(parents=True)
    private_defaults.write_text(json.dumps({"num_processes": 2, "start_method": "spawn"}))
    assert configure(mixed_precision="bf16") == defaults.LaunchDefaults(2, "bf16", "spawn")
    assert configure(start_method="fork").start_method == "fork"


def test_save_writes_the_defaults_file_the_sidebar_reads(private_defaults):
    configure(num_processes=2, mixed_precision="bf16", save=True)
    assert json.loads(private_defaults.read_text()) == {
        "num_processes": 2, "mixed_precision": "bf16", "start_method": None,
    }  # fmt: skip
    assert defaults.load_defaults() == defaults.LaunchDefaults(2, "bf16", None)


def test_a_choice_the_hardware_cannot_run_is_refused_with_the_reason():
    with pytest.raises(DefaultsError, match=r"configure\(\) cannot use this setting: mixed_precision='fp8' "
                       r"cannot run here: fp8 needs a Hopper-class NVIDIA GPU; this machine runs ranks on CPU"):  # fmt: skip
        configure(mixed_precision="fp8")
    with pytest.raises(DefaultsError, match=r"num_processes must be a whole number of at least 1"):
        configure(num_processes=0)
    assert defaults.kernel_defaults() is None  # nothing half-applied


def test_the_panel_disables_what_this_cpu_machine_cannot_run_and_says_why():
    panel = ConfigurePanel(detect())
    assert panel.precision_buttons["fp8"].disabled
    assert not any(panel.precision_buttons[p].disabled for p in ("no", "bf16", "fp16"))
    assert ("<b>fp8</b> is unavailable: fp8 needs a Hopper-class NVIDIA GPU; this machine runs ranks on CPU"
            in panel.reasons.value)  # fmt: skip
    assert panel.precision_buttons["fp8"].tooltip.startswith("fp8 needs a Hopper-class NVIDIA GPU")
    assert [v for _, v in panel.processes.options][-1] == rules.max_num_processes(detect())
    assert panel.processes.options[0] == (f"auto ({detect().default_num_processes})", 0)
    assert panel.processes.label == f"auto ({detect().default_num_processes})"  # shown, not blank


def test_clicking_in_the_panel_sets_this_kernels_defaults():
    panel = ConfigurePanel(detect())
    panel.precision_buttons["bf16"].click()
    panel.processes.value = 1
    panel.start_buttons["fork"].click()
    assert defaults.kernel_defaults() == defaults.LaunchDefaults(1, "bf16", "fork")
    assert panel.precision_buttons["bf16"].button_style == "primary"
    assert panel.precision_buttons["no"].button_style == ""
    assert "1 x CPU rank, bf16, fork" in panel.summary.value
    assert "mixed_precision chosen in this kernel" in panel.summary.value
    panel.save_button.click()
    assert "Saved to" in panel.status.value
    panel.processes.value = 2
    panel.reset_button.click()
    assert defaults.kernel_defaults() is None
    assert panel.processes.value == 1  # the saved file's choice shows again


def test_on_older_gpus_the_panel_offers_one_rank_per_gpu_and_no_bf16(fake_gpus):
    fake_gpus(("Tesla V100-SXM2-16GB", 16384, "7.0"), ("Tesla V100-SXM2-16GB", 16384, "7.0"))
    panel = ConfigurePanel(detect())
    assert [value for _, value in panel.processes.options] == [0, 1, 2]
    assert panel.precision_buttons["bf16"].disabled and not panel.precision_buttons["fp16"].disabled
    assert "bf16 needs an Ampere or newer GPU" in panel.reasons.value
    assert (
        "<b>GPU 1</b>: Tesla V100-SXM2-16GB, 16 GiB, compute capability 7.0" in panel.hardware.value
    )
