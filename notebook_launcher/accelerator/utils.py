"""Seeding and progress bars for training code running in a rank."""

from __future__ import annotations

import os
import random
from typing import Any

import torch
import torch.distributed as dist


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators on every device.

    device_specific: add the rank to the seed, so ranks draw different numbers (e.g.
        for data augmentation) yet every run is reproducible.
    deterministic: also ask torch for deterministic algorithms (slower on GPU).
    """
    if device_specific:
        seed += _rank()
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed % 2**32)
    # manual_seed also seeds every CUDA device, lazily: it does not initialise CUDA.
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _in_launched_rank() -> bool:
    return "WORLD_SIZE" in os.environ or "NOTEBOOK_LAUNCHER_LAUNCH_ID" in os.environ


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """A tqdm progress bar, shown by the main process only unless main_process_only=False.

    In a rank it is the text bar (the launcher streams it into the cell); in a plain
    notebook process it is tqdm.auto's widget.
    """
    if _in_launched_rank():
        from tqdm import tqdm as bar
    else:
        from tqdm.auto import tqdm as bar
    if main_process_only and _rank() != 0:
        kwargs["disable"] = True
    return bar(*args, **kwargs)
