"""Finding: fsdp2-unfreeze-frozen-group-mixed-precision

Progressive unfreezing under FSDP2 mixed precision: a fully_shard group whose
parameters were all frozen in its first forward, with
MixedPrecisionPolicy(param_dtype=bfloat16), cannot be trained later: after
unfreezing one of its parameters, the next backward raises "RuntimeError:
attempting to assign a gradient with dtype 'c10::BFloat16' to a tensor with
grad_dtype 'Float'". With reduce_dtype=bfloat16 and no param_dtype the same
schedule trains, but its gradients are reduced in float32, not in reduce_dtype
(seen with 2 ranks). One root cause: the group's reduce and original dtypes are
taken, once, from the parameters that are trainable at lazy init. Full
precision (the control) trains. Expected (MixedPrecisionPolicy docstring): the
unsharded parameter (and its gradient) is in param_dtype, reduced in
reduce_dtype, whatever requires_grad was in an earlier step.

Run: python fsdp2-unfreeze-frozen-group-mixed-precision.py
Run: torchrun --nproc-per-node 2 fsdp2-unfreeze-frozen-group-mixed-precision.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
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


class Reductions(TorchDispatchMode):
    """The dtypes of the gradient reductions FSDP issues."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "reduce_scatter" in str(func.overloadpacket) or "all_reduce" in str(func.overloadpacket):
            self.dtypes.update([a.dtype for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)][:1])
        return func(*args, **(kwargs or {}))


def run(param_dtype, reduce_dtype):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.requires_grad_(False)  # the frozen backbone
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fully_shard(model[0], mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    with torch.no_grad():  # step 0: everything frozen, forward only
        model(torch.randn(2, 4))
    model[0].weight.requires_grad_(True)  # step 1: unfreeze one parameter
    try:
        with Reductions() as seen:
            model(torch.randn(2, 4)).float().pow(2).sum().backward()
    except RuntimeError as e:
        return f"backward raised RuntimeError {str(e).splitlines()[0][:100]}"
    if reduce_dtype is not None and seen.dtypes - {reduce_dtype}:
        return f"reduced in {sorted(map(str, seen.dtypes))}"
    return None


def main():
    init()
    wrong = [f"param_dtype={p} reduce_dtype={r}: {w}" for p, r in ((None, None), (torch.bfloat16, None), (None, torch.bfloat16))
             if (w := run(p, r))]
    finish(wrong and f"after unfreezing a group frozen in its first forward: {'; '.join(wrong)} (expected it to train in the policy's dtypes)",
           "a group unfrozen after a frozen first forward trains in the policy's dtypes")


if __name__ == "__main__":
    main()
