"""A tiny decoder language model as a Target: the suite's own example of a
real model (tied input/output embedding, decoder blocks, a persistent and a
non-persistent buffer, a greedy ``generate``). The suite's tests and the
README's worked example use it: ``fsdp-conformance model conformance.models.toy_target:target``."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from conformance.case.target import MethodCall, Target

VOCAB, DIM, LAYERS, SEQ = 16, 8, 2, 4


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + torch.tanh(self.attn(self.ln(h))).cumsum(1) / (1 + torch.arange(h.shape[1], device=h.device)[None, :, None])
        return h + self.mlp(h)


class ToyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2's lm_head
        self.register_buffer("scale", torch.ones(dim))
        self.register_buffer("cache", torch.zeros(1), persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 3) -> torch.Tensor:
        """Greedy decoding: what HF's generate does, in a few lines."""
        ids = input_ids
        for _ in range(max_new_tokens):
            nxt = self(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
        return ids


def make_model(seed: int) -> ToyLM:
    with torch.random.fork_rng(devices=[]):  # the caller's RNG state stays as it was
        torch.manual_seed(seed)
        return ToyLM()


def make_inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(1000 + seed)
    return {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=g)}


def lm_loss(logits: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on a fixed target sequence."""
    targets = torch.arange(logits.shape[1], device=logits.device).remainder(VOCAB).expand(logits.shape[0], -1)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


target = Target(
    name="toy-lm",
    factory=make_model,
    inputs=make_inputs,
    loss=lm_loss,
    methods=(MethodCall("generate", {"max_new_tokens": 2}),),
    wrap_classes=("Block",),
    trainable_patterns=(("blocks.1.",), ("bias",), ("norm", "ln")),
)
