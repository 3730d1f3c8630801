"""Finding fsdp1-selective-ac-rate-limiter-op-mismatch (torch 2.13.0).

Selective activation checkpointing (torch.utils.checkpoint with
context_fn=create_selective_checkpoint_contexts) of a region that holds an
FSDP1 unit with every parameter frozen and no gradient flowing through it
(an Embedding here) raises in backward, with FSDP1's default
limit_all_gathers=True:

  RuntimeError: profiler._record_function_enter_new.default invocation index
  10 encountered during backward but not found in storage. This can happen if
  the operations in the checkpointed region are nondeterministic or depend on
  global state that changed between forward and backward.

The frozen unit has no pre-backward hook, so the recomputed forward runs
its full pre-forward and unshards it again. FSDP1's _unshard enters
record_function("FullyShardedDataParallel.rate_limiter") only when the
limit_all_gathers free-event queue holds enough events; in the forward it
did not, in the recompute (after more units resharded) it does. The
selective cache counts that extra profiler op and the lookup fails. The
same region trains with plain checkpointing, with limit_all_gathers=False,
and when the Embedding trains.

Expected: the gradients of the model without checkpointing (input's here).

Torch 2.8.0 and 2.12.1 train it: their selective checkpoint looked up saved
ops only; 2.13 counts every op of the region, the recomputed ones too.

Finding: fsdp1-selective-ac-rate-limiter-op-mismatch
Run: torchrun --nproc-per-node 2 fsdp1-selective-ac-rate-limiter-op-mismatch.py
Not shown by: python fsdp1-selective-ac-rate-limiter-op-mismatch.py: FSDP1 does not shard on one rank (no all-gather, no rate limiter)
"""

import functools
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import CustomPolicy
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj0, self.embed1, self.proj2 = nn.Linear(4, 4), nn.Embedding(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = torch.tanh(self.proj0(x))
        x = x + self.embed1(torch.arange(x.shape[0]) % 4)
        return self.proj2(x)


def save_tanh(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.tanh.default else CheckpointPolicy.PREFER_RECOMPUTE


def train(selective, limit_all_gathers=True):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(4, 1))
    block = model[0]
    kwargs = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, save_tanh)
    block.forward = functools.partial(checkpoint, block.forward, **kwargs)  # checkpoint the block, before FSDP
    for p in model.parameters():
        p.requires_grad_(False)  # frozen (fine-tuning a head elsewhere, say); the input's gradient is wanted
    units = {block.proj0, block.embed1}
    model = FSDP(model, auto_wrap_policy=CustomPolicy(lambda m: m in units), device_id=torch.device("cpu"),
                 limit_all_gathers=limit_all_gathers)
    try:
        model(torch.randn(3, 4, requires_grad=True)).pow(2).sum().backward()
        return None
    except RuntimeError as e:
        return str(e).splitlines()[0][:200]


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() < 2 and rank == 0:
        print("needs 2 ranks (FSDP1 does not shard on one): torchrun --nproc-per-node 2 ...", flush=True)
    plain, selective, unlimited = train(False), train(True), train(True, limit_all_gathers=False)
    if rank == 0:
        for name, err in (("checkpoint", plain), ("selective checkpoint", selective), ("selective, limit_all_gathers=False", unlimited)):
            print(f"{name} around the units:", "backward ok" if err is None else f"raised {err}", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"DEVIATION: selective AC around a frozen FSDP1 unit raises in backward: {selective}"
              if selective is not None and plain is None
              else "AS SPECIFIED: selective AC around the frozen FSDP1 unit trains as plain checkpointing does", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
