"""The sidebar's TypeScript reply types cannot drift from what the server sends."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from notebook_launcher import hardware, rules
from notebook_launcher.defaults import LaunchDefaults
from notebook_launcher.registry import LaunchRecord
from notebook_launcher.server import handlers

API_TS = Path(__file__).resolve().parents[2] / "extension" / "src" / "api.ts"

# TypeScript interface -> the TypedDict in notebook_launcher/server/handlers.py it mirrors.
MIRRORS = {
    "IGpuInfo": handlers.GpuInfoJSON,
    "ITpuInfo": handlers.TpuInfoJSON,
    "IHardwareReport": handlers.HardwareReportJSON,
    "INumProcessesChoice": handlers.NumProcessesChoice,
    "IChoices": handlers.ChoicesJSON,
    "IHardwareReply": handlers.HardwareReply,
    "ILaunchDefaults": handlers.LaunchDefaultsJSON,
    "IDefaultsReply": handlers.DefaultsReply,
    "ILaunchInfo": handlers.LaunchInfo,
    "ILaunchesReply": handlers.LaunchesReply,
}


def typescript_interfaces(source: str) -> dict[str, dict[str, str]]:
    """Each exported interface's fields, name -> TypeScript type."""
    interfaces = {}
    for name, body in re.findall(r"export interface (\w+) \{\n(.*?)\n\}", source, re.S):
        fields = dict(re.findall(r"^\s*(\w+)\??: (.+?);$", body, re.M))
        interfaces[name] = fields
    return interfaces


INTERFACES = typescript_interfaces(API_TS.read_text())


def test_every_reply_interface_is_checked() -> None:
    assert set(INTERFACES) == set(MIRRORS)


@pytest.mark.parametrize("interface", sorted(MIRRORS))
def test_each_interface_has_the_fields_of_its_typeddict(interface: str) -> None:
    typed = MIRRORS[interface].__annotations__
    fields = INTERFACES[interface]
    assert sorted(fields) == sorted(typed)
    for name, annotation in typed.items():
        text = getattr(annotation, "__forward_arg__", str(annotation))
        nullable_py = text.replace(" ", "").endswith("|None")
        nullable_ts = fields[name].replace(" ", "").endswith("|null")
        assert nullable_py == nullable_ts, f"{interface}.{name}: {annotation!r} vs {fields[name]!r}"


def test_the_typeddicts_have_the_keys_the_server_really_sends() -> None:
    report = hardware.detect()
    assert set(report.to_dict()) == set(handlers.HardwareReportJSON.__annotations__)
    assert set(
        report.to_dict()["gpus"][0] if report.gpus else handlers.GpuInfoJSON.__annotations__
    ) == set(handlers.GpuInfoJSON.__annotations__)
    offered = rules.choices(report)
    assert set(offered) == set(handlers.ChoicesJSON.__annotations__)
    assert set(offered["num_processes"]) == set(handlers.NumProcessesChoice.__annotations__)
    assert set(LaunchDefaults().to_dict()) == set(handlers.LaunchDefaultsJSON.__annotations__)
    # pid_namespace tells the registry which kernel pids it may judge; the sidebar never needs it.
    record_keys = set(LaunchRecord.__dataclass_fields__) - {"pid_namespace"} | {"notebook"}
    assert record_keys == set(handlers.LaunchInfo.__annotations__)
    json.dumps(report.to_dict())  # plain JSON data
