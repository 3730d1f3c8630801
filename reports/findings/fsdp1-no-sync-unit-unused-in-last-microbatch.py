"""Finding: fsdp1-no-sync-unit-unused-in-last-microbatch

Gradient accumulation with FSDP1's no_sync(): a unit whose forward ran in a
microbatch inside no_sync() but not in the last (synchronizing) microbatch
makes the last backward fail in FSDP's post-backward callback with
"AssertionError: All sharded parameters that received a gradient in the
post-backward should use `_saved_grad_shard`" (plus a printed stack), on both
use_orig_params settings. A mixture-of-experts model or a conditional branch
hits this when the last microbatch does not route through a wrapped module.
Expected (no_sync docstring): gradients are accumulated in module variables
inside the context and synchronized in the first forward-backward after it;
the accumulated gradient of the skipped unit is reduced like any other (as
single-process training, and FSDP2's set_requires_gradient_sync, do).

Run: torchrun --nproc-per-node 2 fsdp1-no-sync-unit-unused-in-last-microbatch.py
Not shown by: python fsdp1-no-sync-unit-unused-in-last-microbatch.py: one rank falls back to NO_SHARD, which keeps no gradient shard
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


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


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.use_b = True

    def forward(self, x):
        x = self.a(x)
        return self.b(x) if self.use_b else x


def main():
    init()
    failed = []
    for use_orig_params in (False, True):
        model = FSDP(Model(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=use_orig_params,
                     device_id=torch.device("cpu"))
        with model.no_sync():  # microbatch 0: every unit runs, gradients accumulate unsynchronized
            model(torch.randn(2, 3)).sum().backward()
        model.module.use_b = False  # microbatch 1 (synchronizing) does not use unit b
        try:
            model(torch.randn(2, 3)).sum().backward()
        except AssertionError as e:
            failed.append(f"use_orig_params={use_orig_params}: AssertionError {str(e).splitlines()[0][:100]}")
    finish(failed and f"the synchronizing backward after no_sync() raised when unit b did not run in it: {'; '.join(failed)} "
           "(expected b's accumulated gradient reduced)", "the synchronizing backward after no_sync() ran")


if __name__ == "__main__":
    main()
