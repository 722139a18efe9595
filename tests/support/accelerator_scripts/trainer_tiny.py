"""transformers' Trainer with a tiny BERT built from a config (no download), on every rank.

Imported by tests/accelerator/test_accelerator_trainer.py and run inside notebook_launcher's ranks;
``python -m torch.distributed.run ... trainer_tiny.py OUT`` runs the same under torchrun.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


class Sentences(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 32, length: int = 8) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(5, 50, (n, length), generator=generator)
        self.labels = (self.ids.sum(dim=1) % 2).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones_like(self.ids[i]),
            "labels": self.labels[i],
        }


def train(output_dir: str) -> dict[str, Any]:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        max_steps=3,
        seed=0,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
        # Under torchrun on CPU, transformers runs DDP only when told; inside a CPU rank of
        # notebook_launcher it also follows ACCELERATE_USE_CPU, which the launcher sets.
        use_cpu=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Sentences())
    result = trainer.train()
    state = {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()}
    return {
        "world_size": args.world_size,
        "process_index": args.process_index,
        "global_step": result.global_step,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "state_dict": state,
    }


if __name__ == "__main__":
    import torch.distributed as dist

    out = sys.argv[1]
    result = train(out)
    torch.save(result, f"{out}/trainer_rank{result['process_index']}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()
