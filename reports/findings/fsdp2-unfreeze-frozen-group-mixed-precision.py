"""Finding fsdp2-unfreeze-frozen-group-mixed-precision (torch 2.13.0, 2.14.1).

Progressive unfreezing under FSDP2 mixed precision: a fully_shard group whose
parameters were all frozen (requires_grad=False) in its first forward, with
MixedPrecisionPolicy(param_dtype=bfloat16), cannot be trained later. After
unfreezing one of its parameters, the next backward raises
"RuntimeError: attempting to assign a gradient with dtype 'c10::BFloat16' to a
tensor with grad_dtype 'Float'". With reduce_dtype=bfloat16 and no
param_dtype it trains, but reduces that parameter's gradient in float32: the
reduce_dtype is lost too. (FSDPParamGroup._init_mp_dtypes, at the first
forward, takes the group's original and reduce dtypes from the parameters
that require grad then; an all-frozen group gets None for both, for good.)
A group with at least one trainable parameter in its first forward, or the
same schedule without mixed precision, trains as promised.

Expected (MixedPrecisionPolicy docstring): the unsharded parameter (and hence
compute and its gradient) is in param_dtype, reduced in reduce_dtype, and the
optimizer steps on the sharded parameter in its own dtype, whatever
requires_grad was in an earlier step; single-process training unfreezes
without error.

Run: python fsdp2-unfreeze-frozen-group-mixed-precision.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp2-unfreeze-frozen-group-mixed-precision.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode


class ReduceDtypes(TorchDispatchMode):
    """Records the dtype of every gradient-reduction collective."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "reduce_scatter" in str(func.overloadpacket) or "allreduce" in str(func.overloadpacket):
            t = args[0] if isinstance(args[0], torch.Tensor) else args[0][0]
            self.dtypes.add(str(t.dtype))
        return func(*args, **(kwargs or {}))


def run(param_dtype, rank: int, reduce_dtype=None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].requires_grad_(False)  # the frozen backbone
    model[1].requires_grad_(False)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fully_shard(model[0], mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    x = torch.randn(2, 4)
    with torch.no_grad():  # step 0: everything frozen, forward only
        model(x)
    model[0].weight.requires_grad_(True)  # step 1: unfreeze one parameter
    what = f"param_dtype={param_dtype}, reduce_dtype={reduce_dtype}"
    try:
        with ReduceDtypes() as rec:
            model(x).float().pow(2).sum().backward()
        got = model[0].weight.grad
        print(f"[rank {rank}] {what}: backward ran, grad {None if got is None else got.dtype}, reduced in {sorted(rec.dtypes)}")
    except RuntimeError as e:
        print(f"[rank {rank}] {what}: backward raised RuntimeError: {str(e).splitlines()[0][:120]}")


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    run(None, rank)  # full precision: trains
    run(torch.bfloat16, rank)  # raises
    run(None, rank, reduce_dtype=torch.bfloat16)  # reduces in float32, not bfloat16
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
