"""LoRA through an Accelerator, then TRL's SFTTrainer and transformers' Trainer, on every rank.

Run in notebook_launcher's ranks with our Accelerator (``core="ours"``), and by
``python -m torch.distributed.run ... finetune_pair.py OUT`` with accelerate's own
Accelerator under torchrun: one run of each covers all three comparisons.
"""

from __future__ import annotations

import sys
from typing import Any

import lora_tiny
import sft_tiny
import torch


def train(out_dir: str, core: str = "ours") -> dict[str, Any]:
    return {"lora": lora_tiny.train(out_dir, core), **sft_tiny.train(out_dir)}


if __name__ == "__main__":
    import torch.distributed as dist

    out = sys.argv[1]
    result = train(out, "accelerate")
    torch.save(result, f"{out}/pair_rank{result['lora']['process_index']}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()
