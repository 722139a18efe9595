"""A small language model of plain torch for the big-model tests: embeddings tied to the
output head, a stack of residual blocks, and a buffer that no checkpoint holds."""

from __future__ import annotations

import torch


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(torch.nn.functional.gelu(self.up(self.norm(hidden))))


class TinyLM(torch.nn.Module):
    def __init__(self, layers: int = 6, width: int = 32, vocab: int = 50) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2 and Llama
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden) * self.scale
