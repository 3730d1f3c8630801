"""Finding fsdp2-unfreeze-frozen-group-mixed-precision (torch 2.13.0; fixed in 2.14.1).

Progressive unfreezing under FSDP2 mixed precision: a fully_shard group whose
parameters were all frozen (requires_grad=False) in its first forward, with
MixedPrecisionPolicy(param_dtype=bfloat16), cannot be trained later. After
unfreezing one of its parameters, the next backward raises
"RuntimeError: attempting to assign a gradient with dtype 'c10::BFloat16' to a
tensor with grad_dtype 'Float'". With reduce_dtype=bfloat16 and no param_dtype
the same schedule trains, but its gradients are reduced in float32, not in
reduce_dtype (seen under torchrun with 2 ranks). One root cause: the group's
reduce and original dtypes are taken, once, from the parameters that are
trainable at lazy init; a group with none keeps no reduce dtype. A group with
at least one trainable parameter in its first forward trains as promised.

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


class Reductions(TorchDispatchMode):
    """The dtypes of the gradient reductions FSDP issues."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "reduce_scatter" in str(func.overloadpacket) or "all_reduce" in str(func.overloadpacket):
            self.dtypes += [a.dtype for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)][:1]
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
    what = f"param_dtype={param_dtype} reduce_dtype={reduce_dtype}"
    try:
        with Reductions() as seen:
            model(x).float().pow(2).sum().backward()
        got = model[0].weight.grad
        print(f"[rank {rank}] {what}: backward ran, grad {None if got is None else got.dtype}, "
              f"reduced in {seen.dtypes or 'nothing (one rank)'}" + (" (expected torch.bfloat16)" if reduce_dtype else ""))
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
    run(None, rank, reduce_dtype=torch.bfloat16)  # trains, but reduces in float32 (2 ranks)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
