"""Finding dcp-ignore-frozen-params-keeps-aliases (torch 2.13.0).

get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
must leave out every frozen parameter (StateDictOptions docstring: "the
returned state_dict won't contain any frozen parameters"). A frozen parameter
that the model holds under two names (a tied weight, a shared module) is
removed under the name model.named_parameters() yields first only; its other
names stay in the state dict. Same under FSDP1 and FSDP2.

Run: python dcp-ignore-frozen-params-keeps-aliases.py   (one gloo rank), or
     torchrun --nproc-per-node 2 dcp-ignore-frozen-params-keeps-aliases.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.proj = nn.Linear(4, 4)
        self.proj.weight.requires_grad_(False)
        self.head_weight = self.proj.weight  # tied: the same frozen Parameter under a second name

    def forward(self, x):
        return self.proj(x) * self.scale


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    model = Model()
    frozen = sorted(n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad)
    fully_shard(model)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))
    kept = sorted(k for k in sd if k in frozen)
    if dist.get_rank() == 0:
        print(f"frozen parameter names: {frozen}")
        print(f"expected: none of them in the state dict; got: {kept}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
