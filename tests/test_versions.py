"""The Python package and the lab extension carry one version, held by extension/package.json."""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from pathlib import Path

import pytest

import notebook_launcher

ROOT = Path(__file__).resolve().parent.parent

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def _version() -> str:
    """The one version: extension/package.json holds it, the Python build reads it."""
    return str(json.loads((ROOT / "extension" / "package.json").read_text())["version"])


def test_the_python_build_reads_its_version_from_package_json() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"], "a second version in pyproject.toml"
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["hatch"]["version"] == {
        "source": "nodejs",
        "path": "extension/package.json",
    }
    assert any(r.startswith("hatch-nodejs-version") for r in pyproject["build-system"]["requires"])


def test_the_version_is_a_release_number() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?", _version()), _version()


def test_the_changelog_has_an_entry_for_this_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert re.search(rf"^## {re.escape(_version())} - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.M)


def test_the_built_lab_extension_has_the_version() -> None:
    built = Path(notebook_launcher.__file__).parent / "labextension" / "package.json"
    if not built.exists():
        pytest.skip(
            f"the lab extension is not built ({built} is missing): run `jlpm build:prod` in extension/"
        )
    assert json.loads(built.read_text())["version"] == _version()


def test_the_installed_distribution_has_the_version() -> None:
    try:
        installed = importlib.metadata.version("notebook-launcher")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("notebook-launcher is not installed (running from the source tree)")
    assert installed == _version()
    assert notebook_launcher.__version__ == installed
