"""Finding: fsdp1-no-shard-no-sync-tied-param-low-precision

FSDP1 with use_orig_params=True, NO_SHARD and MixedPrecision(param_dtype=
bfloat16) (keep_low_precision_grads left False): gradient accumulation under
no_sync() fails on a model with a tied parameter. The no_sync() post-backward
exposes the unit's unsharded bfloat16 gradient through the original
parameters' .grad (the .data work-around of _use_unsharded_grad_views); the
next microbatch's reshard (_use_sharded_grad_views, which under NO_SHARD
finds that gradient "sharded") re-points the tied name's .grad with a plain
assignment, which raises "attempting to assign a gradient with dtype
'c10::BFloat16' to a tensor with grad_dtype 'Float'". With FULL_SHARD (the
control) the same schedule trains. Expected (FullyShardedDataParallel.no_sync
docstring: gradients accumulate and are synchronized in the first
forward-backward after the context; MixedPrecision: keep_low_precision_grads
False upcasts the gradients to full precision): the step runs.

Run: torchrun --nproc-per-node 2 fsdp1-no-shard-no-sync-tied-param-low-precision.py
Run: python fsdp1-no-shard-no-sync-tied-param-low-precision.py (one rank: FSDP1 runs FULL_SHARD as NO_SHARD there, so the control raises too)
"""

import contextlib
import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy


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


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight  # the tie

    def forward(self, x):
        return self.b(self.a(x))


def main():
    init()
    warnings.simplefilter("ignore")  # FSDP's notes about NO_SHARD
    rank = dist.get_rank()
    wrong = []
    for strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.FULL_SHARD):  # FULL_SHARD: the control
        torch.manual_seed(0)
        fsdp = FSDP(Tied(), sharding_strategy=strategy, use_orig_params=True, device_id=torch.device("cpu"),
                    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
        opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
        try:
            for k, sync in enumerate((False, True)):  # gradient accumulation: the first microbatch under no_sync()
                x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * k + rank))
                with contextlib.nullcontext() if sync else fsdp.no_sync():
                    fsdp(x).float().pow(2).sum().backward()
            opt.step()
        except RuntimeError as e:
            wrong.append(f"{strategy.name}: microbatch {k} raised RuntimeError: {str(e).splitlines()[0][:160]}")
    finish(wrong and "; ".join(wrong), "both strategies accumulate under no_sync() and step")


if __name__ == "__main__":
    main()
