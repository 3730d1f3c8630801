"""Source of a small user model, written into a temporary directory by the
tests (a target that lives outside the suite): a tied embedding/head, a
buffer, two layers of the user's own class, a greedy generate(); and one
broken target per kind of bad input."""

SOURCE = '''
import torch
import torch.nn as nn

from conformance import MethodCall, Target


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.norm(h)))


class TinyLM(nn.Module):
    def __init__(self, vocab=12, d=6):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Layer(d), Layer(d)])
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("gain", torch.ones(d))

    def forward(self, input_ids):
        h = self.wte(input_ids) * self.gain
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)

    def generate(self, input_ids, max_new_tokens=2):
        for _ in range(max_new_tokens):
            nxt = self(input_ids)[:, -1].argmax(-1, keepdim=True)
            input_ids = torch.cat([input_ids, nxt], 1)
        return input_ids


class Empty(nn.Module):
    def forward(self, input_ids):
        return input_ids.float()


def factory(seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyLM()


def inputs(seed):
    return {"input_ids": torch.randint(0, 12, (2, 3), generator=torch.Generator().manual_seed(seed))}


def broken_factory(seed):
    raise RuntimeError("out of coffee")


target = Target("tiny-lm", factory, inputs, methods=(MethodCall("generate", {"max_new_tokens": 2}),),
                wrap_classes=("Layer",), trainable_patterns=(("layers.1.",),))
bad_factory = Target("bad-factory", broken_factory, inputs)
no_params = Target("no-params", lambda seed: Empty(), inputs)
bad_inputs = Target("bad-inputs", factory, lambda seed: {"tokens": torch.zeros(2, 3, dtype=torch.long)})
missing_method = Target("missing-method", factory, inputs, methods=(MethodCall("beam_search"),))
bad_class = Target("bad-class", factory, inputs, wrap_classes=("DecoderLayer",))
'''
