"""A target whose registered method adds random noise to its output (a bug
in the user's model that FWD-PARITY must report on real ranks: the sharded
and the unsharded model's outputs differ). ``score`` computes through the
model's submodules without calling the model itself (self(...)), so no
known finding about self-calling methods applies."""

from __future__ import annotations

import torch
import torch.nn as nn

from conformance.case.target import MethodCall, Target

VOCAB, DIM = 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class NoisyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return h

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(input_ids))

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The logits, plus noise from the global RNG: never the same twice."""
        logits = self.head(self.hidden(input_ids))
        return logits + 0.1 * torch.randn_like(logits)


def make_model(seed: int) -> NoisyLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return NoisyLM()


def make_inputs(seed: int) -> dict:
    return {"input_ids": torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(seed))}


target = Target("noisy-lm", make_model, make_inputs, methods=(MethodCall("score"),), wrap_classes=("Block",))
