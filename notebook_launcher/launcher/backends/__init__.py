"""Ways of starting ranks, one module each, found by name.

A backend module defines ``BACKEND``, an instance of
:class:`~notebook_launcher.launcher.backends.base.Backend`; adding one is adding its
module and its line in ``MODULES``. A module that is absent (or whose optional packages
are not installed) makes a launch that needs it refuse up front.
"""

from __future__ import annotations

import importlib

from notebook_launcher.errors import LaunchUnsupportedError
from notebook_launcher.launcher.backends.base import Backend

MODULES = {
    "local": "notebook_launcher.launcher.backends.local",
    "xla": "notebook_launcher.launcher.backends.xla",
    "ray": "notebook_launcher.launcher.backends.ray",
}

_WHAT = {
    "local": "processes of this machine",
    "xla": "TPU cores (torch_xla)",
    "ray": "a Ray cluster",
}


def lookup(name: str) -> Backend:
    """The backend called ``name``; LaunchUnsupportedError where it is not installed."""
    module_name = MODULES.get(name)
    if module_name is None:
        raise LaunchUnsupportedError(
            f"no backend is called {name!r}; the known ones are {', '.join(sorted(MODULES))}."
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            raise LaunchUnsupportedError(
                f"launching on {_WHAT[name]} is not available in this installation of "
                f"notebook_launcher (its {name!r} backend is absent). Pass hardware='cpu' to "
                "run CPU ranks on this machine."
            ) from error
        raise LaunchUnsupportedError(
            f"launching on {_WHAT[name]} needs the package {error.name!r}, which is not "
            f"installed: pip install {error.name}."
        ) from error
    backend: Backend = module.BACKEND
    return backend


def check_supports(backend: Backend, accelerator: str) -> None:
    if accelerator not in backend.accelerators:
        raise LaunchUnsupportedError(
            f"the {backend.name!r} backend cannot run ranks on {accelerator.upper()} (it runs "
            f"them on {', '.join(a.upper() for a in backend.accelerators)}). Pass hardware='cpu' "
            "to run CPU ranks on this machine."
        )
