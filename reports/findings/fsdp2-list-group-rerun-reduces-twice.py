"""Finding fsdp2-list-group-rerun-reduces-twice (torch 2.13.0).

A fully_shard([a, b]) group one of whose modules runs forward again after
the group completed (a, b, then a again: a shared module registered under a
second name), trained with gradient accumulation (a microbatch with
set_requires_gradient_sync(False), then a synced one), reduce-scatters its
gradients twice in the synced backward: the re-run's post-backward reduces
what the group holds at that point (the gradients accumulated in the
unsynced microbatch among them), the root's final callback reduces the rest.
Each parameter's gradient is then the sum of two reductions, in the
parameter's dtype, not one reduction in reduce_dtype of the accumulated
gradient: with MixedPrecisionPolicy(param_dtype=bfloat16) the suite's
MP-PIPELINE sees the gradient one bfloat16 rounding (2e-3 relative) off the
promised pipeline (seed 21), and the group pays a second reduce-scatter.

  2.12.1, 2.13.0, 2.14.1: reduce-scatters in the synced backward: 2 with the re-run, 1 without

Expected: one reduce-scatter per group in a synced backward, of the
gradient accumulated in reduce_dtype (MixedPrecisionPolicy's reduce_dtype:
"If also gradient reduction is disabled via set_requires_gradient_sync,
then FSDP will accumulate gradients using reduce_dtype"; fully_shard: one
reduce-scatter per group in backward, torch's own test_fully_shard_comm
counts).

Finding: fsdp2-list-group-rerun-reduces-twice
Run: torchrun --nproc-per-node 2 fsdp2-list-group-rerun-reduces-twice.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4, 2.5
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


class Model(nn.Module):
    def __init__(self, rerun):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), Inner()
        if rerun:
            self.again = self.a  # the same module under a second name: it runs again after b

    def forward(self, x):
        x = self.b(self.a(x))
        return self.again(x) if hasattr(self, "again") else x


def synced_backward_reduce_scatters(rerun):
    torch.manual_seed(0)
    model = Model(rerun)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard([model.a, model.b], mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    seen = []
    names = [n for n in ("reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}
    for k, sync in enumerate((False, True)):  # gradient accumulation: an unsynced microbatch, then a synced one
        model.set_requires_gradient_sync(sync)
        loss = model(torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * k + dist.get_rank()))).float().pow(2).sum()
        if sync:
            for n in names:
                setattr(dist, n, lambda *a, __n=n, **kw: (seen.append(__n), real[__n](*a, **kw))[1])
        try:
            loss.backward()
        finally:
            for n in names:
                setattr(dist, n, real[n])
    return len(seen)


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    plain, rerun = synced_backward_reduce_scatters(False), synced_backward_reduce_scatters(True)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"torch {torch.__version__}: reduce-scatters in the synced backward: {rerun} with the re-run, {plain} without", flush=True)
        if dist.get_world_size() < 2 and plain == 0:
            print("AS SPECIFIED: one rank: no reduce-scatter at all here (nothing to compare); run it with torchrun --nproc-per-node 2", flush=True)
        elif rerun > plain:
            print(f"DEVIATION: the group whose module runs again reduce-scatters {rerun} times in one synced backward (expected {plain})", flush=True)
        else:
            print("AS SPECIFIED: one reduce-scatter per group in the synced backward", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
