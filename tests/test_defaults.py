"""The launch defaults file: location, validation, atomic save, broken files, the summary line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from notebook_launcher import defaults as d
from notebook_launcher.hardware import GpuInfo, HardwareReport


def _report(
    gpus: tuple[GpuInfo, ...] = (), tpu_cores: int = 0, cpu_count: int = 4
) -> HardwareReport:
    return HardwareReport(
        cpu_count=cpu_count,
        gpus=gpus,
        driver_version="550.54" if gpus else None,
        tpu_cores=tpu_cores,
        mps_available=False,
        platform="local",
        python_version="3.11.9",
        torch_version="2.13.0",
        torch_xla_version=None,
    )


CPU = _report()
TWO_T4 = _report(gpus=(GpuInfo(0, "Tesla T4", 15360, "7.5"), GpuInfo(1, "Tesla T4", 15360, "7.5")))
ONE_H100 = _report(gpus=(GpuInfo(0, "NVIDIA H100 80GB HBM3", 81559, "9.0"),))


@pytest.fixture(autouse=True)
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path / "config"


def test_defaults_file_lives_in_the_jupyter_config_dir(config_dir: Path) -> None:
    assert d.defaults_path() == config_dir / "notebook_launcher" / "defaults.json"


def test_no_file_means_nothing_chosen() -> None:
    assert d.load_defaults() == d.LaunchDefaults()
    assert d.LaunchDefaults().to_dict() == {
        "num_processes": None,
        "mixed_precision": None,
        "start_method": None,
    }


def test_saved_defaults_load_back_and_the_file_is_readable_json() -> None:
    chosen = d.LaunchDefaults(num_processes=2, mixed_precision="bf16", start_method="fork")
    path = d.save_defaults(chosen)
    assert path == d.defaults_path()
    assert json.loads(path.read_text()) == chosen.to_dict()
    assert d.load_defaults() == chosen
    assert [p.name for p in path.parent.iterdir()] == ["defaults.json"]  # no temp file left


def test_a_crash_mid_write_leaves_the_previous_file_intact(monkeypatch: pytest.MonkeyPatch) -> None:
    before = d.LaunchDefaults(num_processes=2, mixed_precision="bf16")
    path = d.save_defaults(before)
    original = path.read_text()

    def crash(src: object, dst: object) -> None:
        raise KeyboardInterrupt  # the process dies between writing and renaming

    monkeypatch.setattr(d.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        d.save_defaults(d.LaunchDefaults(num_processes=1, mixed_precision="no"))
    assert path.read_text() == original
    assert [p.name for p in path.parent.iterdir()] == ["defaults.json"]
    assert d.load_defaults() == before


def test_the_new_content_is_flushed_to_disk_before_the_rename(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(d.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(
        d.os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1]
    )
    d.save_defaults(d.LaunchDefaults(num_processes=3))
    assert events[:2] == ["fsync", "replace"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"num_procs": 2},
            "Unknown launch default 'num_procs'; the known ones are num_processes, mixed_precision, start_method.",
        ),
        (
            {"num_processes": 0},
            "num_processes must be a whole number of at least 1 (or null to use every device), got 0.",
        ),
        (
            {"num_processes": "2"},
            "num_processes must be a whole number of at least 1 (or null to use every device), got '2'.",
        ),
        (
            {"num_processes": True},
            "num_processes must be a whole number of at least 1 (or null to use every device), got True.",
        ),
        (
            {"mixed_precision": "fp32"},
            "mixed_precision must be one of 'no', 'fp16', 'bf16', 'fp8' (or null to decide), got 'fp32'.",
        ),
        (
            {"start_method": "thread"},
            "start_method must be one of 'auto', 'fork', 'forkserver', 'spawn' (or null to decide), got 'thread'.",
        ),
        (
            [1, 2],
            'Launch defaults must be a JSON object such as {"num_processes": 2}, got list: [1, 2].',
        ),
    ],
)
def test_bad_defaults_are_refused_with_the_key_and_value(data: object, message: str) -> None:
    with pytest.raises(d.DefaultsError) as info:
        d.parse_defaults(data)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_null_means_let_the_launcher_decide() -> None:
    assert d.parse_defaults({"num_processes": None, "mixed_precision": None}) == d.LaunchDefaults()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (
            "{not json",
            "it is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
        ),
        (
            '{"mixed_precision": "fp32"}',
            "mixed_precision must be one of 'no', 'fp16', 'bf16', 'fp8' (or null to decide), got 'fp32'",
        ),
    ],
)
def test_a_broken_file_is_ignored_with_a_warning_naming_the_file(
    content: str, problem: str
) -> None:
    path = d.defaults_path()
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.warns(d.DefaultsFileWarning) as record:
        assert d.load_defaults() == d.LaunchDefaults()
    assert str(record[0].message) == (
        f"Ignoring the launch defaults file {path}: {problem}. notebook_launcher() uses its "
        f"built-in defaults until you save new defaults (JupyterLab's Distributed sidebar or "
        f"configure()) or fix or delete that file."
    )
    assert record[0].filename == __file__  # points at the caller, not at defaults.py


def test_impossible_precision_is_refused_with_the_hardware_reason() -> None:
    with pytest.raises(
        d.DefaultsError,
        match=r"^mixed_precision='fp8' cannot run here: fp8 needs a Hopper-class NVIDIA GPU; this machine runs ranks on CPU\.$",
    ):
        d.check_against_hardware(d.LaunchDefaults(mixed_precision="fp8"), CPU)
    d.check_against_hardware(d.LaunchDefaults(mixed_precision="fp16"), CPU)
    with pytest.raises(
        d.DefaultsError,
        match=r"^mixed_precision='bf16' cannot run here: bf16 needs an Ampere or newer GPU .*Tesla T4 is older\.$",
    ):
        d.check_against_hardware(d.LaunchDefaults(mixed_precision="bf16"), TWO_T4)
    d.check_against_hardware(d.LaunchDefaults(mixed_precision="fp8"), ONE_H100)
    d.check_against_hardware(d.LaunchDefaults(mixed_precision="bf16", num_processes=8), CPU)


def test_more_ranks_than_devices_is_refused() -> None:
    with pytest.raises(d.DefaultsError) as info:
        d.check_against_hardware(d.LaunchDefaults(num_processes=3), TWO_T4)
    assert str(info.value) == (
        "num_processes=3 but this machine has 2 GPU(s) (Tesla T4, Tesla T4); each rank needs its "
        "own GPU. Use num_processes<=2, or hardware='cpu' for CPU ranks."
    )


def test_an_unavailable_start_method_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(d.DefaultsError) as info:
        d.check_against_hardware(d.LaunchDefaults(start_method="fork"), CPU)
    assert str(info.value) == (
        f"start_method='fork' cannot run here: this platform ({sys.platform}) has no 'fork' "
        "start method (it has spawn)."
    )


def test_choices_offer_every_option_with_the_reason_where_impossible() -> None:
    offered = d.choices(TWO_T4)
    assert offered["num_processes"] == {
        "min": 1,
        "max": 2,
        "default": 2,
        "note": "At most 2: each rank needs its own GPU.",
    }
    assert offered["mixed_precision"]["fp16"] is None
    assert "Ampere" in offered["mixed_precision"]["bf16"]
    assert set(offered["start_method"]) == {"auto", "fork", "forkserver", "spawn"}
    assert d.choices(CPU)["num_processes"]["max"] == 16  # 4 per core on 4 cores, at least 16


@pytest.mark.parametrize(
    ("chosen", "report", "line"),
    [
        (
            d.LaunchDefaults(num_processes=2, mixed_precision="bf16", start_method="fork"),
            CPU,
            "2 x CPU ranks, bf16, fork",
        ),
        (
            d.LaunchDefaults(),
            CPU,
            "2 x CPU ranks, fp32 (no mixed precision), start method chosen automatically",
        ),
        (
            d.LaunchDefaults(mixed_precision="fp16", start_method="auto"),
            TWO_T4,
            "2 x GPU ranks, fp16, start method chosen automatically",
        ),
        (
            d.LaunchDefaults(num_processes=1, start_method="spawn"),
            ONE_H100,
            "1 x GPU rank, fp32 (no mixed precision), spawn",
        ),
        (
            d.LaunchDefaults(),
            _report(tpu_cores=8),
            "8 x TPU ranks, fp32 (no mixed precision), start method chosen automatically",
        ),
    ],
)
def test_the_summary_line_says_what_a_launch_will_do(
    chosen: d.LaunchDefaults, report: HardwareReport, line: str
) -> None:
    assert d.describe_launch(chosen, report) == line


def _warning_for(path: Path) -> str:
    with pytest.warns(d.DefaultsFileWarning) as record:
        assert d.load_defaults() == d.LaunchDefaults()
    message = str(record[0].message)
    assert message.startswith(f"Ignoring the launch defaults file {path}: ")
    assert message.endswith("or fix or delete that file.")
    return message


def test_a_file_that_is_not_utf8_is_ignored_with_a_warning() -> None:
    path = d.defaults_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"mixed_precision": "bf16\xff"}')
    assert "it is not UTF-8 text (byte 25 is b'\\xff')" in _warning_for(path)


def test_a_fifo_in_place_of_the_file_never_blocks() -> None:
    path = d.defaults_path()
    path.parent.mkdir(parents=True)
    os.mkfifo(path)  # nobody ever writes to it: a blocking open would wait forever
    assert "it is not a regular file but a FIFO (named pipe)" in _warning_for(path)


def test_a_device_in_place_of_the_file_is_not_read() -> None:
    path = d.defaults_path()
    path.parent.mkdir(parents=True)
    path.symlink_to("/dev/zero")  # endless: reading it whole would exhaust memory
    assert "it is not a regular file but a character device" in _warning_for(path)


def test_a_huge_file_is_not_read() -> None:
    path = d.defaults_path()
    path.parent.mkdir(parents=True)
    path.write_text(" " * (d.MAX_FILE_BYTES + 1) + "{}")
    assert f"more than a defaults file can be ({d.MAX_FILE_BYTES})" in _warning_for(path)


def test_a_directory_in_place_of_the_file_is_ignored() -> None:
    path = d.defaults_path()
    path.mkdir(parents=True)
    message = _warning_for(path)
    assert "it cannot be read" in message or "it is not a regular file but a directory" in message


def test_saved_rank_counts_follow_the_launchers_cpu_limit() -> None:
    with pytest.raises(d.DefaultsError) as info:
        d.check_against_hardware(d.LaunchDefaults(num_processes=1_000_000_000), CPU)
    assert str(info.value).startswith(
        "num_processes=1000000000 is more CPU ranks than this machine can run: at most 16 ("
    )
    assert str(info.value).endswith("Use num_processes<=16.")
    d.check_against_hardware(d.LaunchDefaults(num_processes=16), CPU)


def test_configure_in_the_kernel_overrides_the_file_field_by_field() -> None:
    d.save_defaults(d.LaunchDefaults(num_processes=2, mixed_precision="bf16"))
    try:
        d.set_kernel_defaults(d.LaunchDefaults(num_processes=1))
        assert d.kernel_defaults() == d.LaunchDefaults(num_processes=1)
        effective = d.effective_defaults()
        assert effective.values == d.LaunchDefaults(num_processes=1, mixed_precision="bf16")
        assert effective.source_of("num_processes") == d.KERNEL
        assert effective.source_of("mixed_precision") == d.FILE
        assert (
            effective.source_of("start_method") is None and effective.blame("start_method") is None
        )
        assert "configure() in this kernel" in (effective.blame("num_processes") or "")
        assert str(d.defaults_path()) in (effective.blame("mixed_precision") or "")
        assert d.load_defaults() == d.LaunchDefaults(
            num_processes=2, mixed_precision="bf16"
        )  # file untouched
    finally:
        d.set_kernel_defaults(None)
    assert d.effective_defaults().sources == {"num_processes": d.FILE, "mixed_precision": d.FILE}


def test_kernel_defaults_must_be_launch_defaults() -> None:
    with pytest.raises(
        d.DefaultsError, match=r"set_kernel_defaults\(\) takes a LaunchDefaults or None; got dict"
    ):
        d.set_kernel_defaults({"num_processes": 2})  # type: ignore[arg-type]


def test_defaults_errors_are_launch_errors() -> None:
    from notebook_launcher.errors import LaunchConfigError, LaunchError

    assert issubclass(d.DefaultsError, LaunchConfigError) and issubclass(
        d.DefaultsError, LaunchError
    )
