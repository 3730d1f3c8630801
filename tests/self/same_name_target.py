"""A target with two module classes of one __name__: its own LoRA-style
``Linear`` wraps torch's ``nn.Linear``, as PEFT's ``lora.Linear`` does. A
class named by its bare name would be either; the suite must tell them
apart by qualified name (``tests.self.same_name_target.Linear`` against
``torch.nn.modules.linear.Linear``)."""

from __future__ import annotations

import torch
import torch.nn as nn

from conformance.case.target import MethodCall, Target

VOCAB, DIM, RANK = 16, 8, 2


class Linear(nn.Module):
    """A frozen-able base layer plus a low-rank update (lora_B @ lora_A)."""

    def __init__(self, base: nn.Linear, r: int = RANK) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = Linear(nn.Linear(dim, dim))
        self.mlp = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.mlp(torch.tanh(self.attn(h))))


class TinyLoraLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 2) -> torch.Tensor:
        ids = input_ids
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, self(ids)[:, -1].argmax(-1, keepdim=True)], 1)
        return ids


def make_model(seed: int) -> TinyLoraLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyLoraLM()


def make_inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(1000 + seed)
    return {"input_ids": torch.randint(0, VOCAB, (2, 4), generator=g)}


target = Target(
    name="same-name-linear",
    factory=make_model,
    inputs=make_inputs,
    methods=(MethodCall("generate"),),
    # the bare name "Linear" would be ambiguous here: the qualified one is not
    wrap_classes=(f"{__name__}.Linear",),
    trainable_patterns=(("lora_",),),
)
