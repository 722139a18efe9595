"""Whether ipywidgets can render where this code runs, and so which dashboard to show.

Widgets need a Jupyter kernel (JupyterLab, Notebook 7, VS Code, Colab, Kaggle: their
shells are ipykernel's ``ZMQInteractiveShell`` or a subclass) and ipywidgets installed.
A terminal IPython, a script and a plain interpreter get the text dashboard. A kernel
cannot see whether its frontend draws widgets (nbconvert, a bare jupyter_client do not),
so the widget dashboard always carries its text form too, which those frontends show.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from notebook_launcher.errors import LaunchConfigError


def shell_kind() -> str:
    """ "kernel" in a Jupyter kernel, "terminal" in terminal IPython, else "none"."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return "none"
    if getattr(shell, "kernel", None) is not None:
        return "kernel"
    return "terminal"


def ipywidgets_installed() -> bool:
    return importlib.util.find_spec("ipywidgets") is not None


def choose_view(dashboard: Any, shell: str, has_ipywidgets: bool) -> str | None:
    """ "widgets", "text" or None (no dashboard), from the ``dashboard=`` argument."""
    if dashboard is False:
        return None
    if not (dashboard is True or (isinstance(dashboard, str) and dashboard == "auto")):
        raise LaunchConfigError(
            f"dashboard={dashboard!r} is not a dashboard setting; use 'auto' (widgets in a "
            "notebook, text elsewhere), True (the same, and an error if ipywidgets is "
            "missing in a notebook) or False (no dashboard)."
        )
    if shell != "kernel":
        return "text"
    if has_ipywidgets:
        return "widgets"
    if dashboard is True:
        raise LaunchConfigError(
            "dashboard=True needs ipywidgets to draw the dashboard in this notebook, and it "
            "is not installed. Run `pip install ipywidgets` and restart the kernel, or pass "
            "dashboard='auto' for the text dashboard."
        )
    return "text"
