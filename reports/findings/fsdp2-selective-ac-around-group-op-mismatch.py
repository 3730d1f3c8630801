"""Finding fsdp2-selective-ac-around-group-op-mismatch (torch 2.13.0).

Selective activation checkpointing (torch.utils.checkpoint with
context_fn=create_selective_checkpoint_contexts) of a region that holds
modules fully_shard'ed on their own raises in backward:

  RuntimeError: profiler._record_function_enter_new.default invocation index
  8 encountered during backward but not found in storage. This can happen if
  the operations in the checkpointed region are nondeterministic or depend on
  global state that changed between forward and backward.

The selective policy's caching mode counts every op the region runs. In the
forward, FSDP2's pre-/post-forward hooks of the groups inside the region
(FSDP::pre_forward, FSDP::post_forward record_function calls, and the
all-gather's) run ops; in the recomputed forward the groups are in
PRE_BACKWARD and FSDPState._pre_forward / _post_forward return early, so the
recomputed region runs a different op sequence and the cache lookup fails.
Plain (non-selective) checkpointing of the same region trains.

Expected: the gradients of the model without checkpointing.

Finding: fsdp2-selective-ac-around-group-op-mismatch
Run: torchrun --nproc-per-node 2 fsdp2-selective-ac-around-group-op-mismatch.py
Run: python fsdp2-selective-ac-around-group-op-mismatch.py
(one process also reproduces it)
"""

import functools
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj0, self.proj1, self.proj2 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.proj2(torch.tanh(self.proj1(torch.tanh(self.proj0(x)))))


def save_tanh(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.tanh.default else CheckpointPolicy.PREFER_RECOMPUTE


def train(selective):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(4, 1))
    block = model[0]
    kwargs = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, save_tanh)
    block.forward = functools.partial(checkpoint, block.forward, **kwargs)  # checkpoint the block, before FSDP
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(block.proj0, mesh=mesh)
    fully_shard(block.proj1, mesh=mesh)
    fully_shard(model, mesh=mesh)
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
    plain, selective = train(False), train(True)
    if rank == 0:
        print("checkpoint around two fully_shard'ed modules:", "backward ok" if plain is None else f"raised {plain}", flush=True)
        print("selective checkpoint around them:", "backward ok" if selective is None else f"raised {selective}", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"DEVIATION: selective AC around fully_shard'ed modules raises in backward: {selective}" if selective is not None and plain is None
              else "AS SPECIFIED: selective AC around the fully_shard'ed modules trains as plain checkpointing does", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
