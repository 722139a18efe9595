"""LoRA (peft) on a tiny Llama built from a config, trained through an Accelerator on every rank.

Run through finetune_pair.py inside notebook_launcher's ranks with our Accelerator, and
under torchrun with accelerate's own Accelerator (``core="accelerate"``), for comparison.
"""

from __future__ import annotations

import os
from typing import Any

import torch

VOCAB = 64
SAMPLES = 16
LENGTH = 12
STEPS_PER_EPOCH = SAMPLES // (2 * 2)  # 2 ranks of per-rank batch 2


def llama_config(layers: int = 2, hidden: int = 32) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * LENGTH,
    )


def base_model(seed: int = 0, **config: Any) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**config))


def lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def lora_model(seed: int = 0) -> torch.nn.Module:
    from peft import get_peft_model

    return get_peft_model(base_model(seed), lora_config())


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample i starts with token i, so each rank can say which samples it saw."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(7)
        self.ids = torch.randint(SAMPLES, VOCAB, (SAMPLES, LENGTH), generator=generator)
        self.ids[:, 0] = torch.arange(SAMPLES)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def probe() -> torch.Tensor:
    return Tokens().ids[:3]


def _accelerator(core: str) -> Any:
    if core == "accelerate":
        from accelerate import Accelerator

        return Accelerator(cpu=True)
    from notebook_launcher import Accelerator as Ours

    return Ours()


def train(out_dir: str, core: str = "ours") -> dict[str, Any]:
    accelerator = _accelerator(core)
    model = lora_model()
    base_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen: list[int] = []
    losses: list[float] = []
    first_grads: dict[str, torch.Tensor] = {}
    for _ in range(2):
        for batch in loader:
            seen.extend(batch["input_ids"][:, 0].tolist())
            loss = model(**batch).loss
            accelerator.backward(loss)
            if not first_grads:
                first_grads = {
                    n.removeprefix("module."): p.grad.clone()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                }
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    unwrapped = accelerator.unwrap_model(model)
    state = {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}
    result: dict[str, Any] = {
        "world_size": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "seen": seen,
        "losses": losses,
        "trainable": trainable,
        "first_grads": first_grads,
        "adapter": {k: v for k, v in state.items() if "lora_" in k},
        "base_unchanged": all(torch.equal(state[k], v) for k, v in base_before.items()),
    }
    if core == "ours":
        result.update(_save_and_reload(accelerator, model, out_dir))
    return result


def _save_and_reload(accelerator: Any, model: torch.nn.Module, out_dir: str) -> dict[str, Any]:
    from peft import PeftModel

    found: dict[str, Any] = {"memory": accelerator.memory_summary()}
    saved = os.path.join(out_dir, "save_model")
    accelerator.save_model(model, saved)  # every rank calls it; the main process writes
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        pretrained = os.path.join(out_dir, "save_pretrained")
        unwrapped.save_pretrained(pretrained)
        from safetensors.torch import load_file

        found["files"] = {
            d: sorted(os.listdir(os.path.join(out_dir, d)))
            for d in ("save_model", "save_pretrained")
        }
        found["saved_keys"] = sorted(load_file(os.path.join(saved, "adapter_model.safetensors")))
        unwrapped.eval()
        with torch.no_grad():
            expected = unwrapped(input_ids=probe()).logits
            loaded = PeftModel.from_pretrained(base_model(seed=0), saved).eval()
            found["loaded_logits_diff"] = (
                (loaded(input_ids=probe()).logits - expected).abs().max().item()
            )
            merged = loaded.merge_and_unload().eval()
            found["merged_logits_diff"] = (
                (merged(input_ids=probe()).logits - expected).abs().max().item()
            )
            found["merged_is_plain"] = type(merged).__name__
            untrained = base_model(seed=0).eval()(input_ids=probe()).logits
            found["training_changed_logits"] = (untrained - expected).abs().max().item()
    accelerator.wait_for_everyone()
    return found
