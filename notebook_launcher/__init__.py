"""Run a PyTorch training function on every GPU, TPU core or a few CPU processes from a notebook cell."""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("notebook-launcher")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = ["__version__"]
