"""Finding fsdp2-no-sync-unrun-group-reduce-dtype (torch 2.13.0).

Gradient accumulation under FSDP2 mixed precision with a reduce_dtype other
than param_dtype: when the first microbatch (gradient sync disabled with
set_requires_gradient_sync(False)) does not run a submodule's fully_shard
group at all (a conditional branch, an unused expert), that backward fails
with "AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'".
Without reduce_dtype (or with it equal to param_dtype) the same schedule
accumulates and trains.

Expected (MixedPrecisionPolicy docstring, set_requires_gradient_sync
docstring): with gradient sync disabled FSDP accumulates gradients using
reduce_dtype, for the groups that computed some; a group that did not run has
nothing to accumulate.

Run: python fsdp2-no-sync-unrun-group-reduce-dtype.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp2-no-sync-unrun-group-reduce-dtype.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.use_b = True

    def forward(self, x):
        x = self.a(x)
        return self.b(x) if self.use_b else x


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for reduce_dtype in (None, torch.float32):
        torch.manual_seed(0)
        model = Model()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        fully_shard(model.b, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        x = torch.randn(2, 4) * (rank + 1)
        model.set_requires_gradient_sync(False)  # microbatch 0: b's group does not run
        model.use_b = False
        try:
            model(x).float().pow(2).sum().backward()
            model.set_requires_gradient_sync(True)  # microbatch 1: everything, synchronized
            model.use_b = True
            model(x).float().pow(2).sum().backward()
            print(f"[rank {rank}] reduce_dtype={reduce_dtype}: both microbatches ran")
        except AttributeError as e:
            print(f"[rank {rank}] reduce_dtype={reduce_dtype}: the unsynchronized backward raised AttributeError: {e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
