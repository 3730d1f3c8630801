"""Finding fsdp1-rank-divergent-unit-hangs (torch 2.13.0).

Model: root (Linear a, Linear b, Linear c); rank 1's forward passes over a
module the other ranks call. The promise (FullyShardedDataParallel:
data-parallel gradients reduce-scattered and averaged): the mean gradient,
or an error on every rank. FSDP1 runs here on a group of its own with a 3 s
timeout, so that a hang shows as a timeout:

- own (c is its own unit, rank 1 skips c): c is never all-gathered on
  rank 1; the ranks time out (a hang);
- unused (one unit, rank 1 uses none of its parameters): the flat
  parameter gets no gradient on rank 1, whose post-backward hook never
  runs; rank 0 times out in the reduce-scatter;
- partly (one unit, rank 1 skips c only): trains as single-process
  training does (the flat gradient holds zeros for c): as specified;
- backward (b a frozen unit of its own, a and c in the root's, rank 1
  skips a): b runs on both ranks, but only rank 0's b output needs a
  gradient (a's), so only rank 0 runs b's pre-backward hook and
  all-gathers b; rank 1 goes on to the root's reduce-scatter; the ranks
  time out (a hang).

Root cause: FSDP1's all-gather comes from a unit's pre-forward hook (and,
resharded, from its pre-backward hook on outputs that require grad), its
reduce-scatter from the flat parameter's AccumulateGrad hook: a unit one
rank does not call, or that gets no gradient there, issues neither; a
frozen unit whose output needs no gradient on one rank is not all-gathered
in that rank's backward.

Finding: fsdp1-rank-divergent-unit-hangs
Run: torchrun --nproc-per-node 2 fsdp1-rank-divergent-unit-hangs.py own
Run: torchrun --nproc-per-node 2 fsdp1-rank-divergent-unit-hangs.py unused
Run: torchrun --nproc-per-node 2 fsdp1-rank-divergent-unit-hangs.py backward
Not shown by: torchrun --nproc-per-node 2 fsdp1-rank-divergent-unit-hangs.py partly: the unit's other parameters give it a gradient on rank 1
Not shown by: python fsdp1-rank-divergent-unit-hangs.py own: one rank has nothing to diverge from
"""
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn

BACKEND = os.environ.get("FSDP_REPRO_BACKEND", "gloo")  # nccl: every rank on its GPU (cuda:LOCAL_RANK)
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if BACKEND == "nccl" else torch.device("cpu")


def init():
    """torchrun sets RANK; a plain `python` run is one rank on a free port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(BACKEND)


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
import sys

from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Head(nn.Linear):
    pass


class Mid(nn.Linear):
    pass


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), Mid(3, 3), Head(3, 3)
        self.skip = ()

    def forward(self, x):
        if "a" not in self.skip:
            x = self.a(x)
        if "b" not in self.skip:
            x = self.b(x)
        return self.c(x) if "c" not in self.skip else x


def main():
    form = sys.argv[1] if len(sys.argv) > 1 else "own"
    init()
    rank = dist.get_rank()
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    torch.manual_seed(0)
    model = Model().to(DEVICE)
    inner = model
    # "own": c a unit of its own (a and b stay in the root's); "backward":
    # b, frozen, a unit of its own (a and c in the root's); else one unit
    if form == "backward":
        inner.b.requires_grad_(False)
    policy = {"own": ModuleWrapPolicy({Head}), "backward": ModuleWrapPolicy({Mid})}.get(form)
    model = FSDP(model, auto_wrap_policy=policy, process_group=group, device_id=DEVICE, use_orig_params=True)
    skip = {"own": ("c",), "unused": ("a", "b", "c"), "partly": ("c",), "backward": ("a",)}[form]
    inner.skip = skip if rank == 1 else ()
    x = torch.randn(2, 3, device=DEVICE) * (1 + rank)
    deviation = None
    try:
        (model(x) ** 2).sum().backward()
        with FSDP.summon_full_params(model, with_grads=True):
            names = sorted(n for n, p in model.named_parameters() if p.grad is not None)
        print(f"rank {rank}: backward finished; gradients of {names}", flush=True)
    except RuntimeError as e:
        deviation = f"{form}: rank {rank} raised RuntimeError: {str(e).splitlines()[0][:140]} (rank 1 skipped {list(skip)})"
    failed = torch.tensor([int(deviation is not None)])
    dist.all_reduce(failed)  # the default group: intact
    if failed.item() and deviation is None:
        deviation = f"{form}: another rank timed out"
    finish(deviation, f"{form}: every rank finished backward with rank 1 skipping {list(skip)}")


if __name__ == "__main__":
    main()
