"""Finding: fsdp1-keep-low-precision-grads-param-dtype

MixedPrecision(keep_low_precision_grads=True) keeps the gradients in
param_dtype, not in "the dtype used for gradient reduction" its docstring
names: with param_dtype=bfloat16 and reduce_dtype=float32 the reduction runs
in float32 (the reduce-scatter's dtype, recorded below) and the gradient FSDP
leaves for the optimizer is bfloat16; with param_dtype unset and
reduce_dtype=bfloat16 it is float32. Expected (MixedPrecision docstring): "If
True, then FSDP keeps the gradients in the dtype used for gradient reduction".

Run: torchrun --nproc-per-node 2 fsdp1-keep-low-precision-grads-param-dtype.py
Not shown by: python fsdp1-keep-low-precision-grads-param-dtype.py: one rank falls back to NO_SHARD, which reduces nothing
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision
from torch.utils._python_dispatch import TorchDispatchMode


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
    init()
    wrong = []
    for param_dtype, reduce_dtype in ((torch.bfloat16, torch.float32), (None, torch.bfloat16)):
        mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, keep_low_precision_grads=True)
        model = FSDP(nn.Linear(4, 4), mixed_precision=mp, device_id=torch.device("cpu"))
        with ReduceDtypes() as rec:
            model(torch.randn(2, 4)).float().pow(2).sum().backward()
        grad = model._flat_param.grad  # FSDP1's flat parameter: what the optimizer steps on
        if rec.dtypes and grad.dtype not in rec.dtypes:
            wrong.append(f"param_dtype={param_dtype} reduce_dtype={reduce_dtype}: reduced in {sorted(map(str, rec.dtypes))}, "
                         f"gradient kept in {grad.dtype}")
    finish(wrong and f"keep_low_precision_grads=True kept the gradient in another dtype than the reduction's: {'; '.join(wrong)}",
           "keep_low_precision_grads=True kept every gradient in its reduction's dtype")


if __name__ == "__main__":
    main()
