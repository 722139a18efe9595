"""``show_device_map``: the plan of a dispatched model (or of a device map), drawn where it is
asked for: as bars in a notebook, as text in a script."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from notebook_launcher.big_modeling.device_map import DeviceMap, module_sizes
from notebook_launcher.errors import DeviceMapError


def show_device_map(model_or_map: Any) -> None:
    """Draw where each block of a dispatched model (or a device map) lives: in a notebook
    as bars, in a script as text. Returns nothing, so that a cell ending with it draws once."""
    plan: DeviceMap
    if isinstance(model_or_map, torch.nn.Module):
        mapping = getattr(model_or_map, "hf_device_map", None)
        if mapping is None:
            first = next(iter(model_or_map.parameters()), None)
            mapping = {"": str(first.device) if first is not None else "cpu"}
        budgets = mapping.budgets if isinstance(mapping, DeviceMap) else {}
        plan = DeviceMap(mapping, sizes=module_sizes(model_or_map), budgets=budgets)
    elif isinstance(model_or_map, DeviceMap):
        plan = model_or_map
    elif isinstance(model_or_map, Mapping):
        plan = DeviceMap(model_or_map)
    else:
        raise DeviceMapError(
            f"show_device_map() takes a model or a device map, not a {type(model_or_map).__name__}."
        )
    if _in_notebook():
        from IPython import display as ipython_display

        display: Any = ipython_display.display  # untyped
        # Both forms: the text is what a saved notebook shows where HTML is not rendered.
        display({"text/html": plan._repr_html_(), "text/plain": plan.describe()}, raw=True)
    else:
        print(plan.describe())


def _in_notebook() -> bool:
    shell_module = sys.modules.get("IPython")
    if shell_module is None:
        return False
    shell = shell_module.get_ipython()
    return shell is not None and hasattr(shell, "kernel")
