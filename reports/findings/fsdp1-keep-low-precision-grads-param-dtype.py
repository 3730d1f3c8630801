"""Finding fsdp1-keep-low-precision-grads-param-dtype (torch 2.13.0, 2.14.1).

MixedPrecision(keep_low_precision_grads=True) keeps the gradients in
param_dtype, not in "the dtype used for gradient reduction" its docstring
names: with param_dtype=bfloat16 and reduce_dtype=float32 the reduction runs
in float32 (the reduce-scatter's dtype, recorded below) and the gradient
FSDP leaves for the optimizer is bfloat16; with param_dtype unset and
reduce_dtype=bfloat16 it is float32.

Expected (MixedPrecision docstring): "If True, then FSDP keeps the gradients
in the dtype used for gradient reduction".

Run: python fsdp1-keep-low-precision-grads-param-dtype.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp1-keep-low-precision-grads-param-dtype.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision
from torch.utils._python_dispatch import TorchDispatchMode


class ReduceDtypes(TorchDispatchMode):
    """Records the dtype of every gradient-reduction collective."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "reduce_scatter" in str(func.overloadpacket) or "allreduce" in str(func.overloadpacket):
            self.dtypes.add(args[0].dtype if isinstance(args[0], torch.Tensor) else args[0][0].dtype)
        return func(*args, **(kwargs or {}))


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for param_dtype, reduce_dtype in ((torch.bfloat16, torch.float32), (None, torch.bfloat16)):
        torch.manual_seed(0)
        mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, keep_low_precision_grads=True)
        model = FSDP(nn.Linear(4, 4), mixed_precision=mp, device_id=torch.device("cpu"))
        x = torch.randn(2, 4) * (rank + 1)
        with ReduceDtypes() as rec:
            model(x).float().pow(2).sum().backward()
        grad = model._flat_param.grad  # FSDP1's flat parameter: what the optimizer steps on
        print(f"[rank {rank}] param_dtype={param_dtype} reduce_dtype={reduce_dtype}: reduced in {sorted(map(str, rec.dtypes))}, "
              f"gradient kept in {grad.dtype} (expected {reduce_dtype})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
