"""Finding: fsdp1-mixed-precision-forward-without-backward

FSDP1 with MixedPrecision(param_dtype=bfloat16): after a forward whose output
needs no gradient (a microbatch that uses none of the unit's trainable
parameters, so the training loop runs no backward for it), the next backward
is not reduced at all: every rank is left with its own unsharded, unreduced
gradient, in bfloat16, as the FlatParameter's .grad (the optimizer then steps
each rank on its own data, with a low-precision gradient although
keep_low_precision_grads=False). Without param_dtype (the control), or without
the forward-only microbatch, the gradient is reduce-scattered and upcast as
usual. Either use_orig_params. Expected (MixedPrecision docstring; FSDP's data
parallelism): the backward reduces the gradient across ranks (each rank keeps
its shard of the average) and upcasts it to full precision.

Run: python fsdp1-mixed-precision-forward-without-backward.py
Run: torchrun --nproc-per-node 2 fsdp1-mixed-precision-forward-without-backward.py
"""

import copy
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision


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


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 1, bias=False)
        self.use_proj = True

    def forward(self, x):
        return self.proj(x) + x[:, :1] if self.use_proj else 2 * x[:, :1]


def main():
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    wrong = []
    for mp in (None, MixedPrecision(param_dtype=torch.bfloat16)):
        torch.manual_seed(0)  # the same model on every rank
        ref = Gate()  # single-process training on every rank's data
        model = FSDP(copy.deepcopy(ref), mixed_precision=mp, device_id=torch.device("cpu"))
        for k, use in enumerate((False, True)):  # microbatch 0 does not use proj: no backward
            model.module.use_proj = ref.use_proj = use
            xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * k + r)) for r in range(world)]
            loss = model(xs[rank]).float().pow(2).sum()
            if loss.requires_grad:
                loss.backward()
                (sum(ref(x).pow(2).sum() for x in xs) / world).backward()
        grad = model._handle.flat_param.grad  # FSDP1's flat parameter: what the optimizer steps on
        n = model._handle.flat_param.numel()  # this rank's shard
        want = F.pad(ref.proj.weight.grad.flatten(), (0, n * world - 4))[rank * n:(rank + 1) * n]
        if grad.dtype != torch.float32 or grad.shape != want.shape or not torch.allclose(grad.float(), want, rtol=0.02, atol=0.02):
            wrong.append(f"param_dtype={None if mp is None else mp.param_dtype}: rank {rank}'s gradient is {grad.dtype} "
                         f"{grad.float().flatten().tolist()}, its shard of the average {want.tolist()}")
    finish(wrong and f"after a forward without backward, the next backward's gradient is not this rank's float32 shard of the average: {'; '.join(wrong)}",
           "after a forward without backward, the gradient is this rank's float32 shard of the average")


if __name__ == "__main__":
    main()
