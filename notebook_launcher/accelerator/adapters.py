"""Adapters (peft's LoRA and kin): what is saved of a model that trains an adapter alone.

peft is optional and imported only where a model already came from it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch


def is_peft_model(model: torch.nn.Module) -> bool:
    """True for a model wrapped by peft (``get_peft_model``, ``PeftModel.from_pretrained``)."""
    peft = sys.modules.get("peft")
    peft_model = getattr(peft, "PeftModel", None) if peft is not None else None
    return peft_model is not None and isinstance(model, peft_model)


def save_adapter(
    model: torch.nn.Module,
    state_dict: dict[str, Any],
    save_directory: str | os.PathLike[str],
    *,
    safe_serialization: bool,
) -> None:
    """The adapter's weights and config into ``save_directory``, as peft's ``save_pretrained`` writes them.

    ``state_dict`` is the model's full one (gathered from every rank under FSDP2): peft
    keeps the adapter's entries of it, so the frozen base is not written.
    """
    model.save_pretrained(  # type: ignore[operator]
        os.fspath(save_directory), state_dict=state_dict, safe_serialization=safe_serialization
    )
