"""Finding fsdp2-rank-divergent-module-collective-mismatch (torch 2.13.0).

Model: root (Linear a, Linear b, Linear c), c sometimes its own fully_shard
group; rank 1's forward passes over a module the other ranks call (an MoE
expert or a branch not taken). The promise (fully_shard: data-parallel
gradients reduce-scattered across ranks): the mean gradient, or an error on
every rank. FSDP2 runs here on a group of its own with a 3 s timeout, so
that a hang shows as a timeout:

- own (c is its own group, rank 1 skips c): c is never all-gathered on rank
  1; both ranks time out (a hang);
- unused (one group, rank 1 uses none of its parameters): rank 1 issues no
  reduce-scatter; rank 0 times out in its own (had rank 1 a next collective
  on the group, it would pair with it: gloo aborts on a size mismatch);
- partly (one group, rank 1 skips c only): rank 1 reduce-scatters fewer
  elements and gloo aborts its process ("Received data size doesn't match
  expected size"), rank 0 sees the connection reset. That mode kills a rank,
  so torchrun exits non-zero: run it by hand (it is no header mode);
- silent (c, of the root's size, is its own group with
  reshard_after_forward=False, the root's True; every parameter frozen, two
  forwards; rank 1 skips c): no timeout and no error. Rank 1's second
  all-gather (the root's, for the second forward) pairs with rank 0's
  all-gather of c, and rank 0's of the root with rank 1's full_tensor() of
  c: each rank computes with the other group's shards, and the losses and
  the frozen parameters' values differ from the unsharded model's,
  silently (ci seed 81, INIT-DIVERGENT).

Root cause: FSDPParamGroup.post_backward reduces only the parameters that
have a gradient on this rank, and a group's all-gather is issued by its
module's pre-forward: the collectives follow each rank's own control flow.

Finding: fsdp2-rank-divergent-module-collective-mismatch
Run: torchrun --nproc-per-node 2 fsdp2-rank-divergent-module-collective-mismatch.py own
Run: torchrun --nproc-per-node 2 fsdp2-rank-divergent-module-collective-mismatch.py unused
Run: torchrun --nproc-per-node 2 fsdp2-rank-divergent-module-collective-mismatch.py silent
Not shown by: python fsdp2-rank-divergent-module-collective-mismatch.py own: one rank has nothing to diverge from
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
import copy
import sys

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
        self.skip = ()

    def forward(self, x):
        if "a" not in self.skip:
            x = self.a(x)
        if "b" not in self.skip:
            x = self.b(x)
        return self.c(x) if "c" not in self.skip else x


class Silent(nn.Module):
    """A root with a parameter of its own and a child of the same size, every
    parameter frozen (the suite's case, ci seed 81)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(7, 7), requires_grad=False)
        self.c = nn.Linear(7, 7, bias=False).requires_grad_(False)
        self.skip = False

    def forward(self, x):
        x = x @ self.w
        return x if self.skip else self.c(x)


def silent(rank, mesh, x):
    torch.manual_seed(0)
    model = Silent().to(DEVICE)
    ref = copy.deepcopy(model)
    model.skip = ref.skip = rank == 1
    fully_shard(model.c, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)  # the root all-gathers again in the second forward
    x = torch.randn(2, 7, device=DEVICE) * (1 + rank)
    try:
        got = [float((model(x) ** 2).sum()) for _ in range(2)]
        # a collective per DTensor: the root's group stays unsharded after the forward
        final = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    except RuntimeError as e:
        finish(f"silent: rank {rank} raised RuntimeError: {str(e).splitlines()[0][:140]}", "")
    want = float((ref(x) ** 2).sum())
    changed = sorted(n for n, p in ref.named_parameters() if not torch.equal(final[n], p))
    wrong = [round(g, 4) for g in got if abs(g - want) > 1e-4 * max(1.0, abs(want))]
    finish(f"silent: rank {rank}'s losses {[round(g, 4) for g in got]}, the unsharded model's {want:.4f}; frozen parameters "
           f"changed: {changed} (rank 1 skipped c; no error, no timeout)" if wrong or changed else None,
           "silent: every rank's losses and parameters equal the unsharded model's")


def main():
    form = sys.argv[1] if len(sys.argv) > 1 else "own"
    init()
    rank = dist.get_rank()
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    mesh = DeviceMesh.from_group(group, DEVICE.type)
    torch.manual_seed(0)
    model = Model().to(DEVICE)
    x = torch.randn(2, 3, device=DEVICE) * (1 + rank)
    if form == "silent":
        silent(rank, mesh, x)
    skip = {"own": ("c",), "unused": ("a", "b", "c"), "partly": ("c",)}[form]
    if form == "own":
        fully_shard(model.c, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.skip = skip if rank == 1 else ()
    try:
        (model(x) ** 2).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}  # local: no further collective on the group
    except RuntimeError as e:
        deviation = f"{form}: rank {rank} raised RuntimeError: {str(e).splitlines()[0][:140]}"
        if form == "partly":  # the other rank is dead (gloo aborted it): rank 0 speaks for both
            if rank == 0:
                print(f"DEVIATION: {deviation} (rank 1 skipped {list(skip)})", flush=True)
            os._exit(0)
        finish(f"{deviation} (rank 1 skipped {list(skip)})", "")
    print(f"rank {rank}: backward finished; gradients of {sorted(n for n, g in grads.items() if g is not None)}", flush=True)
    finish(None, f"{form}: every rank finished backward with rank 1 skipping {list(skip)}")


if __name__ == "__main__":
    main()
