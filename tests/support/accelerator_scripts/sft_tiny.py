"""TRL's SFTTrainer with LoRA, and transformers' Trainer with a peft model, on every rank.

A tiny Llama built from a config and a word-level tokenizer built in memory (no
download). Run through finetune_pair.py inside notebook_launcher's ranks and under torchrun.
"""

from __future__ import annotations

from typing import Any

import torch

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "a", "mat", "rug", "fast", "slow", "and"]
SAMPLES = 32
NAMES = [
    f"n{i}" for i in range(SAMPLES)
]  # sentence i starts with word n<i>: ranks tell what they saw


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = NAMES + WORDS
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def sentences() -> list[str]:
    generator = torch.Generator().manual_seed(3)
    picks = torch.randint(0, len(WORDS), (SAMPLES, 6), generator=generator)
    return [
        f"{NAMES[i]} " + " ".join(WORDS[j] for j in row) for i, row in enumerate(picks.tolist())
    ]


def llama(vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )


def _adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def sft(output_dir: str) -> dict[str, Any]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tok = tokenizer()
    config = SFTConfig(
        output_dir=output_dir, per_device_train_batch_size=4, learning_rate=2e-2, max_steps=6,
        seed=0, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        use_cpu=True, max_length=16, dataset_num_proc=None, packing=False,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=llama(len(tok)),
        args=config,
        train_dataset=Dataset.from_dict({"text": sentences()}),
        processing_class=tok,
        peft_config=lora(),
    )
    seen: list[int] = []
    for batch in trainer.get_train_dataloader():  # the samples this rank is given in one pass
        seen.extend(batch["input_ids"][:, 0].add(-4).tolist())
    result = trainer.train()
    return {
        "world_size": config.world_size,
        "process_index": config.process_index,
        "global_step": result.global_step,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "samples_seen": seen,
        "adapter": _adapter(trainer.model),
        "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
    }


class Sequences(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        tok = tokenizer()
        self.ids = torch.tensor(
            [tok(s, padding="max_length", max_length=10)["input_ids"][:10] for s in sentences()]
        )

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_with_peft(output_dir: str) -> dict[str, Any]:
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments

    model = get_peft_model(llama(len(tokenizer())), lora())
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=4, learning_rate=2e-2, max_steps=4,
        seed=0, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        use_cpu=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=Sequences())
    result = trainer.train()
    return {
        "world_size": args.world_size,
        "global_step": result.global_step,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "adapter": _adapter(trainer.model),
    }


def train(output_dir: str) -> dict[str, Any]:
    return {"sft": sft(output_dir + "/sft"), "trainer": trainer_with_peft(output_dir + "/trainer")}
