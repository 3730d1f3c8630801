"""Finding: dcp-ignore-frozen-params-keeps-aliases

get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
must leave out every frozen parameter (StateDictOptions docstring: "the
returned state_dict won't contain any frozen parameters"). A frozen parameter
that the model holds under two names (a tied weight, a shared module) is
removed under the name model.named_parameters() yields first only; its other
names stay in the state dict. Same under FSDP1 and FSDP2.

Run: python dcp-ignore-frozen-params-keeps-aliases.py
Run: torchrun --nproc-per-node 2 dcp-ignore-frozen-params-keeps-aliases.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
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


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.proj = nn.Linear(4, 4)
        self.proj.weight.requires_grad_(False)
        self.head_weight = self.proj.weight  # tied: the same frozen Parameter under a second name


def main():
    init()
    model = Model()
    frozen = sorted(n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad)
    fully_shard(model)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))
    kept = sorted(k for k in sd if k in frozen)
    finish(kept and f"get_model_state_dict(ignore_frozen_params=True) kept the frozen {kept} (frozen names: {frozen}), expected none of them",
           f"no frozen name ({frozen}) is in the state dict")


if __name__ == "__main__":
    main()
