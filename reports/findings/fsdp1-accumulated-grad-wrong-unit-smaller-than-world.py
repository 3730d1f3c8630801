"""Finding fsdp1-accumulated-grad-wrong-unit-smaller-than-world (torch 2.13.0).

Gradient accumulation with synchronization on every microbatch (several
backward passes before one optimizer step, without no_sync) under FSDP1 with
use_orig_params=False gives a wrong gradient when a unit's FlatParameter has
fewer elements than the world size (a rank's shard is empty, e.g. a 1x1
weight on two ranks): after the second backward the gradient is no longer the
sum of both microbatches' (-0.0539 instead of -0.0650 below), after the third
it drifts further. With a unit as large as the world size, or
use_orig_params=True, the same schedule accumulates exactly.

Expected (FullyShardedDataParallel docstring / no_sync docstring): FSDP
accumulates gradients across backward passes like nn.Module does (without
no_sync, in the sharded gradient); the result is the large batch's gradient.

Run: torchrun --nproc-per-node 2 fsdp1-accumulated-grad-wrong-unit-smaller-than-world.py
     (python fsdp1-accumulated-grad-wrong-unit-smaller-than-world.py: one rank, where it holds)
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for out_features, in_features in ((1, 1), (3, 4)):
        torch.manual_seed(0)
        ref = nn.Linear(in_features, out_features, bias=False)  # single-process reference
        model = FSDP(nn.Linear(in_features, out_features, bias=False), use_orig_params=False, device_id=torch.device("cpu"))
        with FSDP.summon_full_params(model), torch.no_grad():
            model.module.weight.copy_(ref.weight)
        for k in range(3):  # three microbatches, each rank its own data, synchronized every time
            xs = [torch.randn(2, in_features, generator=torch.Generator().manual_seed(10 * k + r)) for r in range(world)]
            model(xs[rank]).pow(2).sum().backward()
            (sum(ref(x).pow(2).sum() for x in xs) / world).backward()
        shard = model._flat_param.grad  # this rank's shard of the accumulated gradient
        want = ref.weight.grad.flatten()
        if shard is not None and shard.numel():
            start = rank * shard.numel()
            got = shard[: max(0, min(shard.numel(), want.numel() - start))]
            print(f"[rank {rank}] {out_features}x{in_features} weight: accumulated gradient shard {got.tolist()}, "
                  f"single-process {want[start:start + got.numel()].tolist()}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
