"""Finding fsdp2-accumulated-grads-mixed-reduce-dtype (torch 2.13.0, 2.14.1).

Gradient accumulation under FSDP2 mixed precision with a reduce_dtype other
than param_dtype (bfloat16 compute, float32 reduction): when a microbatch
without gradient sync leaves one parameter of a group unused (a skipped
submodule), the group's next synchronizing backward fails with
"AssertionError: FSDP reduce-scatter expects uniform gradient dtype but got
{torch.bfloat16, torch.float32}": the accumulated gradients are kept in
reduce_dtype, the fresh ones of the parameter that was unused before are in
param_dtype, and the reduce-scatter gets both.

Expected (MixedPrecisionPolicy docstring): with gradient sync disabled via
set_requires_gradient_sync, FSDP accumulates gradients using reduce_dtype and
reduces them in reduce_dtype; which parameters an earlier microbatch used
does not matter (single-process training, or every microbatch using every
parameter, works).

Run: python fsdp2-accumulated-grads-mixed-reduce-dtype.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp2-accumulated-grads-mixed-reduce-dtype.py
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
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype))
        x = torch.randn(2, 4) * (rank + 1)
        model.set_requires_gradient_sync(False)  # microbatch 0: b unused, no sync
        model.use_b = False
        model(x).float().pow(2).sum().backward()
        model.set_requires_gradient_sync(True)  # microbatch 1: everything, sync
        model.use_b = True
        try:
            model(x).float().pow(2).sum().backward()
            print(f"[rank {rank}] reduce_dtype={reduce_dtype}: accumulated backward ran, a.weight.grad {model.a.weight.grad.dtype}")
        except AssertionError as e:
            print(f"[rank {rank}] reduce_dtype={reduce_dtype}: last backward raised AssertionError: {e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
