"""The server extension's hardware and defaults endpoints, through a real Jupyter Server."""

from __future__ import annotations

import json
import os
import sys

import pytest

from notebook_launcher import defaults as d
from notebook_launcher import hardware
from tests.support.server import *  # noqa: F403  (a real server, and the api caller)
from tests.support.server import Api


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with no GPU, whatever the test machine has."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("TPU_NUM_DEVICES", raising=False)
    hardware.detect(refresh=True)
    yield
    hardware.detect(refresh=True)


def test_hardware_reports_the_machine_and_the_choices(api: Api, cpu_only: None) -> None:
    torch_was_imported = "torch" in sys.modules
    status, body = api("hardware")
    assert status == 200
    report = hardware.detect()
    assert body["hardware"] == json.loads(json.dumps(report.to_dict()))
    assert body["hardware"]["accelerator"] == "cpu"
    assert body["hardware"]["cpu_count"] >= 1
    assert body["choices"] == json.loads(json.dumps(d.choices(report)))
    assert body["choices"]["mixed_precision"]["fp16"] is None
    assert body["choices"]["mixed_precision"]["fp8"].startswith(
        "fp8 needs a Hopper-class NVIDIA GPU"
    )
    # Reading the hardware never initialises CUDA (nor even imports torch) in the server.
    assert torch_was_imported or "torch" not in sys.modules


def test_defaults_start_empty(api: Api, cpu_only: None) -> None:
    status, body = api("defaults")
    assert status == 200
    assert body == {
        "defaults": {"num_processes": None, "mixed_precision": None, "start_method": None},
        "path": str(d.defaults_path()),
        "description": "2 x CPU ranks, fp32 (no mixed precision), start method chosen automatically"
        if hardware.detect().cpu_count >= 2
        else "1 x CPU rank, fp32 (no mixed precision), start method chosen automatically",
        "problem": None,
    }


def test_posted_defaults_are_saved_where_the_launcher_reads_them(api: Api, cpu_only: None) -> None:
    chosen = {"num_processes": 2, "mixed_precision": "bf16", "start_method": "fork"}
    status, body = api("defaults", method="POST", body=chosen)
    assert status == 200
    assert body["defaults"] == chosen
    assert body["description"] == "2 x CPU ranks, bf16, fork"
    assert json.loads(d.defaults_path().read_text()) == chosen
    assert d.load_defaults() == d.LaunchDefaults(2, "bf16", "fork")  # what the launcher calls
    assert api("defaults")[1]["defaults"] == chosen


def test_post_replaces_every_default(api: Api, cpu_only: None) -> None:
    api("defaults", method="POST", body={"num_processes": 2, "mixed_precision": "bf16"})
    status, body = api("defaults", method="POST", body={"start_method": "spawn"})
    assert status == 200
    assert body["defaults"] == {
        "num_processes": None,
        "mixed_precision": None,
        "start_method": "spawn",
    }


@pytest.mark.parametrize(
    ("sent", "message"),
    [
        (
            {"precision": "bf16"},
            "Unknown launch default 'precision'; the known ones are num_processes, mixed_precision, start_method.",
        ),
        (
            {"mixed_precision": "fp64"},
            "mixed_precision must be one of 'no', 'fp16', 'bf16', 'fp8' (or null to decide), got 'fp64'.",
        ),
        (
            {"num_processes": -1},
            "num_processes must be a whole number of at least 1 (or null to use every device), got -1.",
        ),
        (
            {"start_method": "threads"},
            "start_method must be one of 'auto', 'fork', 'forkserver', 'spawn' (or null to decide), got 'threads'.",
        ),
        (
            {"mixed_precision": "fp8"},
            "mixed_precision='fp8' cannot run here: fp8 needs a Hopper-class NVIDIA GPU; this machine runs ranks on CPU.",
        ),
        (
            "[2]",
            'Launch defaults must be a JSON object such as {"num_processes": 2}, got list: [2].',
        ),
        (
            "{2",
            'The request body is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); send an object such as {"num_processes": 2}.',
        ),
    ],
)
def test_invalid_defaults_are_refused_with_400_and_the_reason(
    api: Api, cpu_only: None, sent: object, message: str
) -> None:
    d.save_defaults(d.LaunchDefaults(num_processes=1))
    status, body = api("defaults", method="POST", body=sent)
    assert (status, body) == (400, {"message": message})
    assert d.load_defaults() == d.LaunchDefaults(num_processes=1)  # nothing was written


def test_a_broken_defaults_file_is_reported_and_ignored(api: Api, cpu_only: None) -> None:
    path = d.defaults_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"num_processes": "all"}')
    status, body = api("defaults")
    assert status == 200
    assert body["defaults"] == d.LaunchDefaults().to_dict()
    assert body["problem"] == (
        f"Ignoring the launch defaults file {path}: num_processes must be a whole number of at "
        f"least 1 (or null to use every device), got 'all'. notebook_launcher() uses its built-in "
        f"defaults until you save new defaults (JupyterLab's Distributed sidebar or configure()) "
        f"or fix or delete that file."
    )


def test_a_save_that_fails_keeps_the_old_file_and_says_why(
    api: Api, cpu_only: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    d.save_defaults(d.LaunchDefaults(num_processes=1, mixed_precision="bf16"))
    original = d.defaults_path().read_text()

    def disk_full(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(d.os, "replace", disk_full)
    status, body = api("defaults", method="POST", body={"num_processes": 2})
    assert status == 500
    assert body == {
        "message": f"Could not save the launch defaults to {d.defaults_path()}: No space left on device. "
        f"Check that the directory is writable."
    }
    assert d.defaults_path().read_text() == original
    assert sorted(p.name for p in d.defaults_path().parent.iterdir()) == ["defaults.json"]


@pytest.mark.parametrize(
    ("method", "parts", "body"),
    [
        ("GET", ("hardware",), None),
        ("GET", ("defaults",), None),
        ("POST", ("defaults",), {"num_processes": 1}),
        ("GET", ("launches",), None),
        ("POST", ("launches", "abc123", "stop"), "{}"),
        ("POST", ("launches", "abc123", "where"), "{}"),
    ],
)
def test_every_endpoint_refuses_a_request_without_the_token(
    api: Api, method: str, parts: tuple[str, ...], body: object
) -> None:
    status, _ = api(*parts, method=method, body=body, headers={"Authorization": ""})
    assert status == 403
    assert not d.defaults_path().exists()


def test_a_wrong_token_is_refused_too(api: Api) -> None:
    status, _ = api("defaults", headers={"Authorization": "token not-the-token"})
    assert status == 403


def _what_a_rank_sees() -> tuple[str, str]:
    import os

    return os.environ["WORLD_SIZE"], os.environ["ACCELERATE_MIXED_PRECISION"]


def test_the_launcher_uses_the_defaults_saved_through_the_server(api: Api, cpu_only: None) -> None:
    from notebook_launcher import notebook_launcher

    chosen = {"num_processes": 1, "mixed_precision": "bf16", "start_method": "fork"}
    assert api("defaults", method="POST", body=chosen)[0] == 200
    assert notebook_launcher(_what_a_rank_sees) == ("1", "bf16")


def test_a_deeply_nested_body_is_refused_with_400(api: Api, cpu_only: None) -> None:
    status, body = api("defaults", method="POST", body="[" * 100_000 + "]" * 100_000)
    assert (status, body) == (
        400,
        {
            "message": "The request body is JSON nested too deeply to be launch defaults; send "
            'an object such as {"num_processes": 2}.'
        },
    )


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda path: path.write_bytes(b'{"num_processes": 2\xff}'), "it is not UTF-8 text"),
        (lambda path: os.mkfifo(path), "it is not a regular file but a FIFO (named pipe)"),
        (
            lambda path: path.symlink_to("/dev/zero"),
            "it is not a regular file but a character device",
        ),
    ],
)
def test_an_unreadable_defaults_file_is_reported_with_200(
    api: Api, cpu_only: None, make: object, problem: str
) -> None:
    path = d.defaults_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    make(path)  # type: ignore[operator]
    status, body = api("defaults")
    assert status == 200
    assert body["defaults"] == d.LaunchDefaults().to_dict()
    assert body["problem"].startswith(f"Ignoring the launch defaults file {path}: {problem}")


def test_the_server_refuses_the_rank_counts_the_launcher_refuses(api: Api, cpu_only: None) -> None:
    from notebook_launcher import LaunchConfigError, notebook_launcher, rules

    limit = rules.max_num_processes(hardware.detect())
    status, body = api("defaults", method="POST", body={"num_processes": 1_000_000_000})
    assert status == 400
    assert body["message"].startswith(
        f"num_processes=1000000000 is more CPU ranks than this machine can run: at most {limit} ("
    )
    with pytest.raises(LaunchConfigError) as caught:
        notebook_launcher(print, num_processes=1_000_000_000)
    assert str(caught.value) == body["message"]
    assert api("defaults", method="POST", body={"num_processes": limit})[0] == 200


def test_the_server_accepts_the_spellings_the_launcher_accepts(api: Api, cpu_only: None) -> None:
    status, body = api("defaults", method="POST", body={"mixed_precision": "BF16"})
    assert status == 200 and body["defaults"]["mixed_precision"] == "bf16"


def test_the_server_refuses_fork_on_macos_as_the_launcher_does(
    api: Api, cpu_only: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    status, body = api("defaults", method="POST", body={"start_method": "fork"})
    monkeypatch.undo()
    assert status == 400
    assert body["message"] == (
        "start_method='fork' cannot run here: fork is not safe on this platform (darwin): a "
        "forked process crashes once system frameworks are loaded."
    )
