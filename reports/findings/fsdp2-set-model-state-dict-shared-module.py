"""Finding: fsdp2-set-model-state-dict-shared-module

set_model_state_dict(model, full_state_dict, StateDictOptions(full_state_dict=True))
on a fully_shard model with a module registered under two names (a shared
submodule: its parameters have two FQNs), or with a module that holds one
Parameter under two of its names (a tie inside one module: a LayerNorm whose
weight is its bias): the full tensors of the second name are not turned into
DTensors (the state-dict walk skips a module seen before and drops a module's
duplicate parameters), and model.load_state_dict fails for that name with
"aten.copy_.default got mixed torch.Tensor and DTensor". A Parameter tied
across two modules (the control) loads. With broadcast_from_rank0=True and a
shared module that holds only a buffer (BufferHolder), the ranks diverge: rank
0 loads, every other rank raises 'Missing key(s) in state_dict:
"shared.running"' (a job that catches nothing then hangs in its next
collective). Expected (set_model_state_dict docstring: loads a full state dict,
as state_dict() gives one, into an FSDP model): the values loaded.

Run: python fsdp2-set-model-state-dict-shared-module.py
Run: torchrun --nproc-per-node 2 fsdp2-set-model-state-dict-shared-module.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard


def init():
    """torchrun sets RANK; a plain `python` run is one gloo rank on a free port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")


def finish(deviation, as_specified):
    """Rank 0 prints the verdict last: DEVIATION if a rank saw one (None: it saw none)."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, deviation)
    dist.barrier()
    if dist.get_rank() == 0:
        found = next((d for d in seen if d), None)
        print(f"DEVIATION: {found}" if found else f"AS SPECIFIED: {as_specified}", flush=True)
    print(end="", flush=True)
    os._exit(0)  # every rank leaves here, the group not torn down (gloo's teardown can abort a rank now and then)


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.shared = self.proj  # the same Linear under a second name


class TiedInOneModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.norm.weight = self.norm.bias  # one Parameter, two names of one module


class TiedAcrossModules(nn.Module):  # the control: loads
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight


class BufferHolder(nn.Module):  # a shared module with a buffer and no parameter
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.stats = nn.Module()
        self.stats.register_buffer("running", torch.zeros(4))
        self.shared = self.stats


def load(cls, broadcast):
    torch.manual_seed(1)  # the same full state dict on every rank
    full = dict(cls().state_dict())
    model = cls()
    fully_shard(model)
    src = full if dist.get_rank() == 0 or not broadcast else {}
    try:
        set_model_state_dict(model, dict(src), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast))
    except Exception as e:
        return f"{cls.__name__}{' (broadcast_from_rank0)' if broadcast else ''}: {type(e).__name__} {' '.join(str(e).split())[:120]}"
    if broadcast:  # (rank 0 loads where the others raise: no collective after it)
        return None
    params = dict(model.named_parameters(remove_duplicate=False))
    if not all(torch.equal(params[k].full_tensor(), v) for k, v in full.items() if k in params):
        return f"{cls.__name__}: loaded other values"
    return None


def main():
    init()
    cases = ((Shared, False), (TiedInOneModule, False), (TiedAcrossModules, False), (BufferHolder, True))
    wrong = [r for cls, broadcast in cases if (r := load(cls, broadcast))]
    finish(wrong and f"rank {dist.get_rank()}: set_model_state_dict(full_state_dict=True) failed: {'; '.join(wrong)}",
           "set_model_state_dict loaded every model's full state dict")


if __name__ == "__main__":
    main()
