"""A target with torch's nn.MultiheadAttention inside each block: the
module type size_based_auto_wrap_policy keeps as a leaf (its children,
out_proj, are never wrapped, nor is it)."""

from __future__ import annotations

import torch
import torch.nn as nn

from conformance.case.target import Target

VOCAB, DIM = 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.ff = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.ff(self.attn(h, h, h, need_weights=False)[0])


class AttnLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return h


def make_model(seed: int) -> AttnLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AttnLM()


def make_inputs(seed: int) -> dict:
    return {"input_ids": torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(seed))}


target = Target("attn-lm", make_model, make_inputs, wrap_classes=("Block",))
