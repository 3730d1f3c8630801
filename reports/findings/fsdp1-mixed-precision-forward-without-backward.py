"""Finding fsdp1-mixed-precision-forward-without-backward (torch 2.13.0, 2.14.1).

FSDP1 with MixedPrecision(param_dtype=bfloat16): after a forward whose
output needs no gradient (a microbatch that uses none of the unit's
trainable parameters, so the training loop runs no backward for it), the
next backward is not reduced at all: every rank is left with its own
unsharded, unreduced gradient, in bfloat16, as the FlatParameter's .grad
(the optimizer then steps each rank on its own data, with a low-precision
gradient although keep_low_precision_grads=False). Without param_dtype, or
without the forward-only microbatch, the gradient is reduce-scattered and
upcast as usual. Either use_orig_params.

Expected (MixedPrecision docstring; FSDP's data parallelism): the backward
reduces the gradient across ranks (each rank keeps its shard of the average)
and, keep_low_precision_grads being False, upcasts it to full precision.

Run: python fsdp1-mixed-precision-forward-without-backward.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp1-mixed-precision-forward-without-backward.py
"""

import copy
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 1, bias=False)
        self.use_proj = True

    def forward(self, x):
        return self.proj(x) + x[:, :1] if self.use_proj else 2 * x[:, :1]


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for mp in (None, MixedPrecision(param_dtype=torch.bfloat16)):
        torch.manual_seed(0)
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
        with FSDP.summon_full_params(model):
            shard = model._handle.flat_param._local_shard.numel()
        print(f"[rank {rank}] param_dtype={None if mp is None else mp.param_dtype}: gradient {grad.dtype} with {grad.numel()} elements "
              f"(this rank's shard: {shard}), {grad.float().flatten().tolist()[:4]}; "
              f"single-process training's (the average): {ref.proj.weight.grad.flatten().tolist()}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
