"""The Jupyter Server extension behind JupyterLab's "Distributed" sidebar.

Importing this package is cheap: tornado, jupyter_server and the handlers are imported
only when the server loads the extension.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp

LABEXTENSION_NAME = "notebook-launcher-labextension"


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where the prebuilt lab extension lies, for ``jupyter labextension develop``."""
    return [
        {
            "src": str(Path(__file__).resolve().parent.parent / "labextension"),
            "dest": LABEXTENSION_NAME,
        }
    ]


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    return [{"module": "notebook_launcher.server"}]


def _load_jupyter_server_extension(serverapp: ServerApp) -> None:
    from notebook_launcher.server.handlers import setup_handlers

    setup_handlers(serverapp.web_app)
    serverapp.log.info("notebook_launcher: REST endpoints under /notebook-launcher/")
