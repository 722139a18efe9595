"""The declared floors are the versions CI tests, and the runtimes' pins satisfy them.

compat/oldest.txt is the environment of the floors (``make test-compat`` runs the
kernel-facing tests there); compat/colab.txt and compat/kaggle.txt hold what those runtimes
ship, which their users cannot change.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "compat"
RUNTIMES = ("colab", "kaggle")
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pins(name: str) -> dict[str, Requirement]:
    lines = (COMPAT / f"{name}.txt").read_text().splitlines()
    found = [Requirement(line.split("#", 1)[0]) for line in lines if line.split("#", 1)[0].strip()]
    return {canonicalize_name(r.name): r for r in found}


def pinned_version(requirement: Requirement) -> Version | None:
    exact = [s.version for s in requirement.specifier if s.operator == "=="]
    return Version(exact[0]) if exact else None


def floor(requirement: Requirement) -> Version | None:
    floors = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    return max(floors) if floors else None


def python_of(name: str) -> str:
    found = re.search(r"^# python: (3\.\d+)$", (COMPAT / f"{name}.txt").read_text(), re.M)
    assert found, f"compat/{name}.txt does not say which Python it is for ('# python: 3.X')"
    return found.group(1)


DEPENDENCIES = [Requirement(r) for r in PROJECT["dependencies"]]
EXTRAS = [Requirement(r) for rs in PROJECT["optional-dependencies"].values() for r in rs]


def test_every_dependency_has_a_floor_that_oldest_pins_exactly() -> None:
    oldest = pins("oldest")
    for requirement in DEPENDENCIES:
        name = canonicalize_name(requirement.name)
        assert floor(requirement) is not None, f"{requirement}: no floor"
        assert name in oldest, f"{requirement}: compat/oldest.txt does not pin {name}"
        assert pinned_version(oldest[name]) == floor(requirement), (
            f"pyproject says {requirement}, compat/oldest.txt pins {oldest[name]}: "
            "the floor must be the version CI tests"
        )


def test_an_extra_that_names_a_package_oldest_pins_has_that_floor() -> None:
    oldest = pins("oldest")
    checked = []
    for requirement in EXTRAS:
        name = canonicalize_name(requirement.name)
        if name in oldest:
            checked.append(name)
            assert floor(requirement) == pinned_version(oldest[name]), (
                f"an extra says {requirement}, compat/oldest.txt pins {oldest[name]}"
            )
    assert {"ipykernel", "jupyter-client"} <= set(checked)


def test_oldest_pins_each_of_its_packages_exactly() -> None:
    loose = [str(r) for r in pins("oldest").values() if pinned_version(r) is None]
    assert not loose, f"compat/oldest.txt must pin exact versions: {loose}"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_runtimes_pins_satisfy_every_floor(runtime: str) -> None:
    """What a runtime ships already meets the package's requirements: pip replaces nothing."""
    shipped = pins(runtime)
    for requirement in DEPENDENCIES:
        name = canonicalize_name(requirement.name)
        if name in shipped and (version := pinned_version(shipped[name])) is not None:
            assert requirement.specifier.contains(version, prereleases=True), (
                f"{runtime} ships {name} {version}; pyproject requires {requirement}"
            )


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_runtimes_pin_their_kernel_widgets_and_torch(runtime: str) -> None:
    shipped = pins(runtime)
    for name in ("ipython", "ipykernel", "ipywidgets", "jupyter-client", "traitlets", "torch"):
        assert name in shipped and pinned_version(shipped[name]), f"{runtime}: {name} unpinned"


def test_requires_python_is_the_oldest_python_and_admits_the_runtimes() -> None:
    required = SpecifierSet(PROJECT["requires-python"])
    assert PROJECT["requires-python"] == f">={python_of('oldest')}"
    for runtime in RUNTIMES:
        assert required.contains(python_of(runtime)), runtime
    listed = {
        c.rsplit(" :: ", 1)[1]
        for c in PROJECT["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    }
    wanted = {python_of(name) for name in ("oldest", *RUNTIMES)}
    assert wanted <= listed, f"classifiers lack {sorted(wanted - listed)}"


@pytest.mark.parametrize("name", ["oldest", *RUNTIMES])
def test_a_pin_file_says_where_its_pins_come_from_without_an_address(name: str) -> None:
    text = (COMPAT / f"{name}.txt").read_text()
    comment = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert f"Python {python_of(name)}" in comment
    assert not re.search(r"://|www\.|\.(com|org|io|dev)\b", text), f"compat/{name}.txt"


def test_every_test_the_compat_runs_name_exists() -> None:
    """compat/tests.txt names test files by name alone; each must be one file under tests/
    that defines the named test (a renamed test would otherwise drop out unseen)."""
    text = (COMPAT / "tests.txt").read_text()
    nodes = [w for line in text.splitlines() for w in line.split("#", 1)[0].split()]
    nodes = [n for n in nodes if not n.startswith("-")]
    assert len(nodes) >= 10
    for node in nodes:
        name, _, test = node.partition("::")
        found = list((ROOT / "tests").rglob(name))
        assert len(found) == 1, f"compat/tests.txt: {name} matches {found}"
        if test:
            assert re.search(rf"^def {re.escape(test)}\(", found[0].read_text(), re.M), node
