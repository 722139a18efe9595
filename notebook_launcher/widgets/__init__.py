"""Seeing and choosing in the cell: the ``configure()`` panel and the launch dashboard.

Light to import: ipywidgets is imported only when a panel or a widget dashboard is
actually shown, so ``import notebook_launcher`` stays cheap for the server
extension and the command line.
"""

from __future__ import annotations

from notebook_launcher.launcher.events import LaunchObserver
from notebook_launcher.widgets.frontend import choose_view, ipywidgets_installed, shell_kind
from notebook_launcher.widgets.history import launches
from notebook_launcher.widgets.panel import configure

__all__ = ["configure", "dashboard_observer", "launches"]


def dashboard_observer(dashboard: bool | str) -> LaunchObserver | None:
    """The observer ``notebook_launcher(dashboard=...)`` adds, for where it runs."""
    view = choose_view(dashboard, shell_kind(), ipywidgets_installed())
    if view == "widgets":
        from notebook_launcher.widgets.dashboard import WidgetDashboard

        return WidgetDashboard()
    if view == "text":
        from notebook_launcher.widgets.text import TextDashboard

        return TextDashboard()
    return None
