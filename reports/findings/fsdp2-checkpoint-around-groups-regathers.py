"""Finding fsdp2-checkpoint-around-groups-regathers (torch 2.8.0).

Activation checkpointing (torch.utils.checkpoint, non-reentrant; selective
AC too) around a module that holds two fully_shard'ed children gathers each
child's group twice in backward: once when the recompute re-runs the
child's forward (its pre-forward hook unshards it, its post-forward reshards
it), once more in the group's own pre-backward. Without the checkpoint each
group is gathered once in backward, as fully_shard's reshard_after_forward
implies.

  2.8.0:  backward all-gathers without AC: 2, with checkpoint around the block: 4
  2.12.1: 2 and 2 (as specified); 2.13.0 and 2.14.1: 2 and 2

Expected: a recompute reads the parameters FSDP gathers for the backward of
the groups it holds; it adds no all-gather (torch.utils.checkpoint's
docstring: a memory-for-compute trade; fully_shard's: reshard after
forward, all-gather again in backward).

Finding: fsdp2-checkpoint-around-groups-regathers
Run: torchrun --nproc-per-node 2 fsdp2-checkpoint-around-groups-regathers.py
Run: python fsdp2-checkpoint-around-groups-regathers.py
"""

import functools
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.4, 2.5
    from torch.distributed._composable.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj0, self.proj1 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.proj1(torch.tanh(self.proj0(x)))


class Model(nn.Module):
    def __init__(self, ac):
        super().__init__()
        self.block = Block()
        if ac:  # the block's forward checkpointed (non-reentrant)
            self.block.forward = functools.partial(checkpoint, self.block.forward, use_reentrant=False)

    def forward(self, x):
        return self.block(x)


def backward_gathers(ac):
    """The all-gathers FSDP2 issues during one backward (it calls
    dist.all_gather_into_tensor up to 2.12, dist.all_gather_single from 2.13)."""
    torch.manual_seed(0)
    model = Model(ac)
    fully_shard(model.block.proj0)
    fully_shard(model.block.proj1)
    fully_shard(model)
    loss = model(torch.randn(2, 4, requires_grad=True)).sum()
    seen = []
    names = [n for n in ("all_gather_into_tensor", "all_gather_single") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, lambda *a, __n=n, **kw: (seen.append(__n), real[__n](*a, **kw))[1])
    try:
        loss.backward()
    finally:
        for n in names:
            setattr(dist, n, real[n])
    return len(seen)


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    plain, ac = backward_gathers(False), backward_gathers(True)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"torch {torch.__version__}: backward all-gathers without AC: {plain}, with checkpoint around the block: {ac}", flush=True)
        if plain == 0:
            print("AS SPECIFIED: no all-gather in backward at all here (nothing to compare)", flush=True)
        elif ac > plain:
            print(f"DEVIATION: checkpointing around two fully_shard'ed modules adds {ac - plain} all-gathers to the backward ({plain} -> {ac})", flush=True)
        else:
            print("AS SPECIFIED: the recompute adds no all-gather", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
