"""The Python package and the lab extension carry one version."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest

import notebook_launcher

ROOT = Path(__file__).resolve().parent.parent

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def _python_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def test_package_json_has_the_python_version() -> None:
    package = json.loads((ROOT / "extension" / "package.json").read_text())
    assert package["version"] == _python_version()


def test_the_built_lab_extension_has_the_python_version() -> None:
    built = Path(notebook_launcher.__file__).parent / "labextension" / "package.json"
    if not built.exists():
        pytest.skip(
            f"the lab extension is not built ({built} is missing): run `jlpm build:prod` in extension/"
        )
    assert json.loads(built.read_text())["version"] == _python_version()


def test_the_installed_distribution_has_the_python_version() -> None:
    try:
        installed = importlib.metadata.version("notebook-launcher")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("notebook-launcher is not installed (running from the source tree)")
    assert installed == _python_version()
