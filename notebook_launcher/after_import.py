"""Adjusting a module of another package once it is imported, in the process that needs it."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def after_import(name: str, adjust: Callable[[ModuleType], None]) -> None:
    """Call ``adjust(module)`` on the module ``name``: now if it is imported, else right
    after its first import has run it (before the importer sees it)."""
    module = sys.modules.get(name)
    if module is not None:
        adjust(module)
    elif not any(isinstance(f, _Hook) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook(name, adjust))


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, adjust: Callable[[ModuleType], None]) -> None:
        self.name = name
        self._adjust = adjust

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module
        adjust = self._adjust

        def exec_module(module: ModuleType) -> None:
            execute(module)
            adjust(module)

        loader.exec_module = exec_module
        return spec
