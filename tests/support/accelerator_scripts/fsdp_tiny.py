"""FSDP2 through the Accelerator on transformers models built from configs, with and without LoRA.

Imported by tests/accelerator/test_finetune_fsdp.py and run inside notebook_launcher's ranks: one
launch checks the default units of Llama, GPT-2 and BERT, LoRA on the sharded base,
full and adapter saving, and gradient checkpointing under DDP and FSDP2; two more
measure each rank's memory under DDP and under FSDP2 on the same model.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lora_tiny import base_model, lora_config, lora_model, probe

TOKENS = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(5))


def _fsdp_accelerator() -> Any:
    from notebook_launcher import Accelerator
    from notebook_launcher.accelerator.kwargs import FullyShardedDataParallelPlugin

    return Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())


def families() -> dict[str, Any]:
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    def gpt2() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT2LMHeadModel(
            GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
        )

    def bert() -> torch.nn.Module:
        torch.manual_seed(0)
        return BertForMaskedLM(BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=16,
        ))  # fmt: skip

    return {"llama": base_model, "gpt2": gpt2, "bert": bert}


def _units(model: torch.nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [
        type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule) and m is not model
    ]


def _batch(rank: int) -> dict[str, torch.Tensor]:
    ids = TOKENS[2 * rank : 2 * rank + 2]
    return {"input_ids": ids, "labels": ids}


def full_model(name: str, make: Any, rank: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    accelerator = _fsdp_accelerator()
    model = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for _ in range(3):
        loss = model(**_batch(rank)).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        sharded_logits = model(input_ids=TOKENS[:2]).logits
    state = accelerator.get_state_dict(model)  # a collective: every rank; rank 0 gets it
    reload_diff = None
    if rank == 0:
        fresh = make().eval()
        fresh.load_state_dict(state)
        with torch.no_grad():
            reload_diff = (fresh(input_ids=TOKENS[:2]).logits - sharded_logits).abs().max().item()
    return {
        "units": _units(model),
        "all_sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "losses": losses,
        "full_state_reload_diff": reload_diff,
    }


def lora_on_sharded_base(out_dir: str, rank: int) -> dict[str, Any]:
    from peft import PeftModel
    from torch.distributed.tensor import DTensor

    accelerator = _fsdp_accelerator()
    model = lora_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for _ in range(3):
        loss = model(**_batch(rank)).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe()).logits
    full = accelerator.get_state_dict(model)  # rank 0's: the base as it was, the adapter trained
    saved = os.path.join(out_dir, "fsdp_adapter")
    accelerator.save_model(model, saved)
    accelerator.wait_for_everyone()
    loaded = PeftModel.from_pretrained(base_model(seed=0), saved).eval()
    with torch.no_grad():
        loaded_diff = (loaded(input_ids=probe()).logits - logits).abs().max().item()
    return {
        "units": _units(model),
        "frozen_sharded": bool(frozen) and all(isinstance(p, DTensor) for p in frozen),
        "frozen_local_fraction": sum(p.to_local().numel() for p in frozen)
        / sum(p.numel() for p in frozen),
        "trainable_count": len(trainable),
        "losses": losses,
        "base_unchanged": rank != 0
        or all(torch.equal(full[k], v) for k, v in before.items() if "lora_" not in k),
        "lora_changed": rank != 0
        or any(not torch.equal(full[k], v) for k, v in before.items() if "lora_B" in k),
        "saved_files": sorted(os.listdir(saved)),
        "adapter_reload_diff": loaded_diff,
    }


def checkpointed_losses(sharding: str, checkpointing: bool, rank: int) -> list[float]:
    """LoRA losses through ``prepare`` with or without (non-reentrant) gradient checkpointing."""
    from peft import get_peft_model

    from notebook_launcher import Accelerator

    accelerator = _fsdp_accelerator() if sharding == "fsdp" else Accelerator()
    model = base_model(seed=0)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, lora_config())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    losses = []
    for _ in range(3):
        loss = model(**_batch(rank)).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def memory_of(sharding: str) -> dict[str, Any]:
    """Full fine-tuning of a bigger Llama with AdamW, in a launch of its own: the rank's
    peak memory is then this training's alone (the dashboard's figure)."""
    from notebook_launcher import Accelerator

    accelerator = _fsdp_accelerator() if sharding == "fsdp" else Accelerator()
    model = base_model(seed=0, layers=4, hidden=512)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(2):
        loss = model(**_batch(accelerator.process_index)).loss
        accelerator.backward(loss)
        optimizer.step()
    return accelerator.memory_summary()


def run(out_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    from notebook_launcher import Accelerator

    rank = Accelerator().process_index
    result: dict[str, Any] = {"world_size": dist.get_world_size()}
    result["families"] = {name: full_model(name, make, rank) for name, make in families().items()}
    result["lora"] = lora_on_sharded_base(out_dir, rank)
    result["checkpointing"] = {
        (sharding, checkpointing): checkpointed_losses(sharding, checkpointing, rank)
        for sharding in ("ddp", "fsdp")
        for checkpointing in (False, True)
    }
    return result
