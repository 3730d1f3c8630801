"""Finding fsdp2-set-model-state-dict-shared-module (torch 2.13.0, 2.14.1).

set_model_state_dict(model, full_state_dict, StateDictOptions(full_state_dict=True))
on a fully_shard model with a module registered under two names (a shared
submodule: its parameters have two FQNs), or with a module that holds one
Parameter under two of its names (a tie inside one module: here a LayerNorm
whose weight is its bias): the full tensors of the second name are not turned
into DTensors (the state-dict walk skips a module seen before and drops a
module's duplicate parameters), and model.load_state_dict fails for that name
with "aten.copy_.default got mixed torch.Tensor and DTensor" (a one-element
tensor: "in-place operations that require placement changes are not
supported"). The same happens for the meta-device init + to_empty +
set_model_state_dict recipe. A Parameter tied across two modules loads (shown
last). Expected (set_model_state_dict docstring: loads a full state dict, as
state_dict() gives one, into an FSDP model): the values loaded, the module
still shared, the tie kept.

With broadcast_from_rank0=True and a shared module that holds only a buffer
(BufferHolder, shown after the first three), the ranks diverge: rank 0 loads,
every other rank raises 'Missing key(s) in state_dict: "shared.running"' (the
broadcast walks the same deduplicated state dict, so the other ranks never
get the second name). A job that catches nothing then hangs in its next
collective on rank 0; the suite saw that hang (seed 2601, 3 ranks). Run it
with 2 ranks to see the divergence.

Run: python fsdp2-set-model-state-dict-shared-module.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp2-set-model-state-dict-shared-module.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.shared = self.proj  # the same Linear under a second name

    def forward(self, x):
        return self.shared(self.proj(x))


class TiedInOneModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.norm.weight = self.norm.bias  # one Parameter, two names of one module

    def forward(self, x):
        return self.norm(x)


class TiedAcrossModules(nn.Module):  # for contrast: loads
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


class BufferHolder(nn.Module):  # a shared module with a buffer and no parameter
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.stats = nn.Module()
        self.stats.register_buffer("running", torch.zeros(4))
        self.shared = self.stats

    def forward(self, x):
        return self.proj(x) + self.shared.running


def load_broadcast(cls):
    torch.manual_seed(1)
    full = {k: v.clone() for k, v in cls().state_dict().items()}
    model = cls()
    fully_shard(model)
    rank = dist.get_rank()
    try:
        set_model_state_dict(model, dict(full) if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        got = "loaded"
    except Exception as e:
        got = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    print(f"rank {rank}: {cls.__name__} (broadcast_from_rank0): {got}", flush=True)


def load(cls):
    torch.manual_seed(1)
    full = {k: v.clone() for k, v in cls().state_dict().items()}
    torch.manual_seed(0)
    model = cls()
    fully_shard(model)
    try:
        set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True))  # it replaces the dict's values
        params = dict(model.named_parameters(remove_duplicate=False))
        ok = all(torch.equal(params[k].full_tensor(), v) for k, v in full.items())
        print(f"rank {dist.get_rank()}: {cls.__name__}: loaded, values equal {ok}, parameters {len(list(model.parameters()))}")
    except Exception as e:
        print(f"rank {dist.get_rank()}: {cls.__name__}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    for cls in (Model, TiedInOneModule, TiedAcrossModules):
        load(cls)
    load_broadcast(BufferHolder)
    dist.barrier()
    os._exit(0)  # every rank leaves here: no gloo teardown


if __name__ == "__main__":
    main()
