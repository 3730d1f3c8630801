"""Finding fsdp1-shared-module-state-dict-drops-aliases (torch 2.13.0, 2.14.1).

FSDP1, use_orig_params=False: a module registered under several names (T5's
`shared` embedding is also encoder.embed_tokens and decoder.embed_tokens)
that is not itself an FSDP unit, whose parameter is flattened into the unit
that reaches it first. Flattening replaces the module's Parameter with a plain
tensor attribute, so under every other name (here `shared.weight` at the root
and `b.emb.weight` in another unit) the parameter is gone from the full
state_dict: the checkpoint misses keys the unwrapped model has, and loading it
with strict=True into the unwrapped model fails. With use_orig_params=True the
keys are complete.

Expected (FullyShardedDataParallel state_dict, FULL_STATE_DICT): the keys of
the unwrapped model's state_dict. Related but different:
fsdp1-shared-unit-state-dict-alias (the shared module itself is a unit: its
second name gets '<name>._flat_param'). In T5 under ModuleWrapPolicy({T5Stack})
the same wrap also places the shared parameter below its users' common
ancestor (fsdp1-tie-below-lca-not-rejected), so forward then fails too.

Run: python fsdp1-shared-module-state-dict-drops-aliases.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp1-shared-module-state-dict-drops-aliases.py
"""

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Stack(nn.Module):  # T5Stack: the wrap unit; its embedding is shared
    def __init__(self, emb):
        super().__init__()
        self.emb = emb
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.proj(self.emb(x))


class Model(nn.Module):
    pass


def build():
    torch.manual_seed(0)
    model = Model()
    emb = nn.Embedding(8, 4)
    model.shared = emb  # one module, three names
    model.a = Stack(emb)
    model.b = Stack(emb)
    return model


def main():
    if "RANK" not in os.environ:  # plain `python`: a one-process gloo group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    for use_orig_params in (False, True):
        model = build()
        want = list(model.state_dict())
        fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Stack}), use_orig_params=use_orig_params, device_id=torch.device("cpu"))
        got = [k.replace("_fsdp_wrapped_module.", "") for k in fsdp.state_dict()]
        if dist.get_rank() == 0:
            print(f"use_orig_params={use_orig_params}: state_dict missing {sorted(set(want) - set(got))} (expected none), extra {sorted(set(got) - set(want))}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
