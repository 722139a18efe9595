"""The user's model inside what the training core wraps around it."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP and torch.compile wrappers."""
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
