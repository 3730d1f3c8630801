"""Finding fsdp2-shared-module-across-groups (torch 2.13.0, 2.14.1).

A module registered under two parents (one nn.Linear as block.lin and as
shared) whose parameters end up visible to two fully_shard groups: the first
group shards them (the module's parameters become DTensors), the second
group's fully_shard meets those DTensors, takes them for tensor-parallel
parameters and fails inside DeviceMesh._concatenate with
"TypeError: Invariant encountered: value was None when it should not be".

Expected: torch 2.13's own check for a parameter two groups see (ValueError
naming the parameter and prescribing fully_shard([a, b]) or sharding the
shared module first), or the fully_shard docstring's promise that parameters
already assigned by an earlier call are left out; not an internal TypeError.

Run: python fsdp2-shared-module-across-groups.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp2-shared-module-across-groups.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.shared = self.block.lin  # the same Linear under a second name

    def forward(self, x):
        return self.shared(self.block(x))


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    model = Model()
    fully_shard(model.block)
    try:
        fully_shard(model)
        model(torch.randn(2, 4))
        print("no error: the shared Linear is managed once")
    except Exception as e:
        print(f"{type(e).__name__}: {str(e).splitlines()[0]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
