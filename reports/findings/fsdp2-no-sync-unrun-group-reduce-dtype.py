"""Finding: fsdp2-no-sync-unrun-group-reduce-dtype

Gradient accumulation under FSDP2 mixed precision with a reduce_dtype other
than param_dtype: when the first microbatch (gradient sync disabled with
set_requires_gradient_sync(False)) does not run a submodule's fully_shard
group at all (a conditional branch, an unused expert), that backward fails
with "AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'".
Without reduce_dtype (the control) the same schedule accumulates and trains.
Expected (MixedPrecisionPolicy and set_requires_gradient_sync docstrings):
with gradient sync disabled FSDP accumulates gradients using reduce_dtype, for
the groups that computed some; a group that did not run has nothing to
accumulate.

Run: python fsdp2-no-sync-unrun-group-reduce-dtype.py
Run: torchrun --nproc-per-node 2 fsdp2-no-sync-unrun-group-reduce-dtype.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


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
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.use_b = True

    def forward(self, x):
        x = self.a(x)
        return self.b(x) if self.use_b else x


def main():
    init()
    failed = []
    for reduce_dtype in (None, torch.float32):
        model = Model()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        fully_shard(model.b, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        try:
            for use_b in (False, True):  # microbatch 0: b's group does not run, no sync; 1: everything, sync
                model.set_requires_gradient_sync(use_b)
                model.use_b = use_b
                model(torch.randn(2, 4)).float().pow(2).sum().backward()
        except AttributeError as e:
            failed.append(f"reduce_dtype={reduce_dtype}: AttributeError {e}")
    finish(failed and f"gradient accumulation with a group that did not run in the no-sync microbatch raised: {'; '.join(failed)} (expected it to train)",
           "gradient accumulation with a group that did not run in the no-sync microbatch trained")


if __name__ == "__main__":
    main()
