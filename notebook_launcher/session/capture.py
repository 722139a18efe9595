"""Which of the notebook's names a cell uses, and their values to send to the ranks."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

import cloudpickle

from notebook_launcher.errors import LaunchConfigError

# IPython's own names in the user namespace: never sent.
_IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit", "open"})


def used_names(code: str) -> set[str]:
    """Every name the code reads, at any depth (inside functions and classes too)."""
    tree = ast.parse(code)
    return {
        node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    }


def notebook_values(
    code: str, user_ns: Mapping[str, Any], skip: set[str] | frozenset[str] = frozenset(),
    hidden: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The notebook's values of the names ``code`` uses, minus ``skip`` (names the ranks own).

    Raises LaunchConfigError naming the variable when a value cannot travel by value.
    """
    hidden = hidden or {}
    chosen: dict[str, Any] = {}
    for name in sorted(used_names(code)):
        if name in skip or name in _IPYTHON_NAMES or name.startswith("_") or name not in user_ns:
            continue
        value = user_ns[name]
        if name in hidden and hidden[name] is value:
            continue  # put there by IPython or an extension, not by the user
        chosen[name] = value
    try:
        cloudpickle.dumps(chosen)
    except Exception:
        for name, value in chosen.items():
            try:
                cloudpickle.dumps(value)
            except Exception as error:
                kind = type(value)
                raise LaunchConfigError(
                    f"the cell uses the notebook's {name!r} (a {kind.__module__}.{kind.__qualname__}), "
                    f"which cannot be sent to the ranks: {type(error).__name__}: {error}. Create it "
                    "on the ranks instead, in a %%distributed cell."
                ) from error
        raise
    return chosen
