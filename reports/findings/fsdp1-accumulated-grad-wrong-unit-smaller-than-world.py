"""Finding: fsdp1-accumulated-grad-wrong-unit-smaller-than-world

Gradient accumulation with synchronization on every microbatch (several
backward passes before one optimizer step, without no_sync) under FSDP1 with
use_orig_params=False gives a wrong gradient when a unit's FlatParameter has
fewer elements than the world size (a rank's shard is empty, e.g. a 1x1
weight on two ranks): after the second backward the gradient is no longer the
sum of both microbatches'. With a unit as large as the world size (the 3x4
weight below), or use_orig_params=True, the same schedule accumulates exactly.
Expected (FullyShardedDataParallel / no_sync docstrings): FSDP accumulates
gradients across backward passes like nn.Module does; the result is the large
batch's gradient.

Run: torchrun --nproc-per-node 2 fsdp1-accumulated-grad-wrong-unit-smaller-than-world.py
Not shown by: python fsdp1-accumulated-grad-wrong-unit-smaller-than-world.py: one rank never has an empty shard
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


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


def main():
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    wrong = []
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
        start = rank * shard.numel()
        got = shard[: max(0, min(shard.numel(), ref.weight.numel() - start))]
        want = ref.weight.grad.flatten()[start:start + got.numel()]
        if not torch.allclose(got, want, atol=1e-5):
            wrong.append(f"{out_features}x{in_features} weight: {got.tolist()} on rank {rank}, single-process {want.tolist()}")
    finish(wrong and f"the gradient accumulated over 3 synchronized backwards differs from single-process training: {'; '.join(wrong)}",
           "every accumulated gradient equals single-process training's")


if __name__ == "__main__":
    main()
