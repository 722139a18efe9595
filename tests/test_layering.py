"""The package's imports run one way: no module imports one that imports it back, and
the launcher knows no UI.

Every import counts, wherever it is written: at the top of a module, inside a function
(a lazy import still ties the two modules together) and under ``TYPE_CHECKING`` (a type
shared by two modules still says which one is below the other). A module's own parent
packages are not counted: Python runs them before the module anyway.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "notebook_launcher"
LAUNCHER = "notebook_launcher.launcher"
# What the launcher must not reach, directly or through the modules it imports: the
# widgets, sessions and the server are built on it, and IPython or ipywidgets would tie it
# to a notebook.
NOT_BELOW_LAUNCHER = (
    "notebook_launcher.widgets",
    "notebook_launcher.session",
    "notebook_launcher.server",
    "IPython",
    "ipywidgets",
)


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package) for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _imported_names(module: str, is_package: bool, tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Each name an import statement anywhere in ``tree`` loads, with its line.

    ``from a.b import c`` loads the module ``a.b.c`` where that is a module, else ``a.b``.
    """
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                yield (candidate if candidate in MODULES else source), node.lineno


def _owner(name: str) -> str | None:
    """The module of the package a dotted name lives in (None: not ours)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports() -> dict[str, dict[str, int]]:
    """Module -> {module or outside name it imports: first line that does}."""
    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_package) in MODULES.items():
        edges = graph.setdefault(module, {})
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name, line in _imported_names(module, is_package, tree):
            target = _owner(name) or name
            if target != module and not module.startswith(f"{target}."):
                edges.setdefault(target, line)
    return graph


GRAPH = _imports()


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in graph:
                continue  # outside the package
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _describe(group: list[str]) -> str:
    lines = [" <-> ".join(group)]
    for module in group:
        for target, line in sorted(GRAPH[module].items()):
            if target in group:
                lines.append(
                    f"  {MODULES[module][0].relative_to(PACKAGE.parent)}:{line} imports {target}"
                )
    return "\n".join(lines)


def _reach(start: str) -> dict[str, list[str]]:
    """Everything ``start`` imports, directly or not, each with one chain of imports to it."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        module = todo.pop()
        for target in GRAPH.get(module, {}):
            if target not in paths:
                paths[target] = [*paths[module], target]
                if target in GRAPH:
                    todo.append(target)
    return paths


def test_the_import_parser_sees_every_kind_of_import() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import notebook_launcher.errors\n"
        "from . import rank_group\n"
        "from .backends import base\n"
        "from ..hardware import detect\n"
        "if TYPE_CHECKING:\n"
        "    from notebook_launcher.tpu import TpuInfo\n"
        "def f():\n"
        "    from notebook_launcher.launcher.rank import RankSpec\n"
        "    import ipywidgets.widgets\n"
    )
    tree = ast.parse(source)
    names = {
        _owner(n) or n for n, _ in _imported_names("notebook_launcher.launcher.x", False, tree)
    }
    assert names == {
        "typing",
        "notebook_launcher.errors",
        "notebook_launcher.launcher.rank_group",
        "notebook_launcher.launcher.backends.base",
        "notebook_launcher.hardware",
        "notebook_launcher.tpu",
        "notebook_launcher.launcher.rank",
        "ipywidgets.widgets",
    }
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        ["a", "b", "c"]
    ]


def test_the_graph_covers_the_package() -> None:
    assert {
        "notebook_launcher",
        LAUNCHER,
        "notebook_launcher.launcher.rank",
        "notebook_launcher.rules",
    } <= set(GRAPH)
    assert "notebook_launcher.rules" in GRAPH["notebook_launcher.hardware"]


def test_no_module_imports_one_that_imports_it_back() -> None:
    cycles = _cycles(GRAPH)
    assert cycles == [], "import cycles:\n" + "\n".join(_describe(g) for g in cycles)


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if m == LAUNCHER or m.startswith(f"{LAUNCHER}."))
)
def test_the_launcher_knows_no_ui(module: str) -> None:
    reached = _reach(module)
    found = {}
    for banned in NOT_BELOW_LAUNCHER:
        chains = [
            chain
            for name, chain in reached.items()
            if name == banned or name.startswith(f"{banned}.")
        ]
        if chains:
            found[banned] = " -> ".join(min(chains, key=len))
    assert found == {}, f"{module} reaches what is built on the launcher: {found}"


def _room(module: str) -> str:
    """The package (or top-level module) of the package's that ``module`` belongs to:
    ``notebook_launcher.launcher.backends.ray`` is in ``notebook_launcher.launcher``."""
    return ".".join(module.split(".")[:2])


def _rooms() -> dict[str, dict[str, int]]:
    """Room -> {room it imports: how many imports say so}; the package's root is no room
    (every module's parent, it is run first and imports the public API from the rooms)."""
    graph: dict[str, dict[str, int]] = {}
    for module, targets in GRAPH.items():
        room = _room(module)
        if room == "notebook_launcher":
            continue
        edges = graph.setdefault(room, {})
        for target in targets:
            if target in GRAPH and _room(target) not in (room, "notebook_launcher"):
                edges[_room(target)] = edges.get(_room(target), 0) + 1
    return graph


# No exception: a cycle between two rooms is a shared piece that belongs below both.
ALLOWED_ROOM_CYCLES: list[list[str]] = []


def test_the_package_cycle_check_sees_a_cycle_through_submodules() -> None:
    assert _cycles({"a": {"b": 1}, "b": {"a": 1}}) == [["a", "b"]]
    assert _room("notebook_launcher.launcher.backends.ray") == "notebook_launcher.launcher"
    assert _room("notebook_launcher.registry") == "notebook_launcher.registry"


def test_no_package_imports_one_that_imports_it_back() -> None:
    """Packages too, not only modules: the launcher's modules may import the registry
    while the registry imports one launcher module that imports none of them, and the two
    rooms still lean on each other (a lazy import included)."""
    rooms = _rooms()
    cycles = [group for group in _cycles(rooms) if group not in ALLOWED_ROOM_CYCLES]
    described = []
    for group in cycles:
        lines = [" <-> ".join(group)]
        for module, targets in sorted(GRAPH.items()):
            for target, line in sorted(targets.items()):
                if (
                    _room(module) in group
                    and target in GRAPH
                    and _room(target) in group
                    and _room(target) != _room(module)
                ):
                    path = MODULES[module][0].relative_to(PACKAGE.parent)
                    lines.append(f"  {path}:{line} imports {target}")
        described.append("\n".join(lines))
    assert cycles == [], "package cycles:\n" + "\n".join(described)
