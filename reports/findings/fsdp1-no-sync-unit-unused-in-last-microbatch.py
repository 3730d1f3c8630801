"""Finding fsdp1-no-sync-unit-unused-in-last-microbatch (torch 2.13.0, 2.14.1).

Gradient accumulation with FSDP1's no_sync(): a unit whose forward ran in a
microbatch inside no_sync() but not in the last (synchronizing) microbatch
makes the last backward fail in FSDP's post-backward callback with
"AssertionError: All sharded parameters that received a gradient in the
post-backward should use `_saved_grad_shard`" (plus a printed stack), on both
use_orig_params settings. A mixture-of-experts model or a conditional branch
hits this when the last microbatch does not route through a wrapped module.

Expected (no_sync docstring): gradients are accumulated in module variables
inside the context and synchronized in the first forward-backward after it;
the accumulated gradient of the skipped unit is reduced like any other (as
single-process training, and FSDP2's set_requires_gradient_sync, do).

Run: python fsdp1-no-sync-unit-unused-in-last-microbatch.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp1-no-sync-unit-unused-in-last-microbatch.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Block()
        self.b = Block()
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
    for use_orig_params in (False, True):
        torch.manual_seed(0)
        model = FSDP(Model(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=use_orig_params,
                     device_id=torch.device("cpu"))
        x = torch.randn(2, 3) * (rank + 1)
        with model.no_sync():  # microbatch 0: every unit runs, gradients accumulate unsynchronized
            model(x).sum().backward()
        model.module.use_b = False  # microbatch 1 (synchronizing) does not use unit b
        try:
            model(x).sum().backward()
            print(f"[rank {rank}] use_orig_params={use_orig_params}: accumulated backward ran")
        except AssertionError as e:
            print(f"[rank {rank}] use_orig_params={use_orig_params}: last backward raised AssertionError: {e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
