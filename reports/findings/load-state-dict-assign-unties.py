"""Finding load-state-dict-assign-unties (torch 2.13.0).

nn.Module.load_state_dict(state_dict, assign=True) -- the load FSDP2's
meta-device recipe uses (DTensors laid out as the model's, assign=True), and
the usual load of pretrained weights into a meta-initialized model before
FSDP1 wraps it -- replaces each name's Parameter with its own new Parameter:
names that shared one Parameter (tied weights: an LM head and its embedding)
no longer do, and model.parameters() has one more entry per tie. Expected:
tied names still share one Parameter, the parameter count unchanged.

Run: python load-state-dict-assign-unties.py   (one gloo rank), or
     torchrun --nproc-per-node 2 load-state-dict-assign-unties.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, x):
        return self.head(self.embed(x))


def report(what, model):
    tied = model.head.weight is model.embed.weight
    n = len(list(model.parameters()))
    if dist.get_rank() == 0:
        print(f"{what}: tied {tied}, {n} parameters (expected: tied True, 1 parameter)")


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    full = {k: v.clone() for k, v in LM().state_dict().items()}
    plain = LM()
    plain.load_state_dict(full, assign=True)
    report("plain module, load_state_dict(assign=True)", plain)
    model = LM()
    fully_shard(model)
    sharded = {k: distribute_tensor(full[k], v.device_mesh, v.placements) for k, v in model.state_dict().items()}
    model.load_state_dict(sharded, assign=True)
    report("fully_shard, load_state_dict(DTensor state dict, assign=True)", model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
