"""Finding fsdp2-gloo-reduce-scatter-avg-sums (torch 2.8.0; not 2.9.1, 2.13.0).

FSDP2 (fully_shard) on a gloo process group with more than one rank: after
backward each parameter's gradient is the SUM of the ranks' gradients, not
their mean, whenever the reduction runs in float32 or bfloat16 (the default,
and MixedPrecisionPolicy(reduce_dtype=float32)). A float16 reduce_dtype is
averaged correctly.

Expected (fully_shard / MixedPrecisionPolicy docs, as DDP does): gradients are
reduce-scattered and averaged over the data-parallel ranks, so one SGD step
matches single-process training on the ranks' inputs with a mean loss.

Root cause (torch 2.8.0): FSDP2's
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py
_get_gradient_divide_factors returns (no pre/post divide, ReduceOp.AVG) for a
float32/bfloat16 reduce_dtype whatever the backend, and foreach_reduce passes
that op to dist.reduce_scatter_tensor. The 2.8.0 gloo process group
(c10d ProcessGroupGloo) accepts ReduceOp.AVG (it no longer raises "Cannot use
ReduceOp.AVG with Gloo") and divides for all_reduce, but its reduce_scatter
(reduce_scatter_tensor and the list form) returns the plain sum: this script
shows dist.reduce_scatter_tensor(op=AVG) == SUM on 2.8.0. A float16
reduce_dtype takes the SUM-plus-divide path and is right. torch 2.9.1 and
2.13.0 average in gloo's reduce_scatter, and FSDP2 is right there.

Run: python fsdp2-gloo-reduce-scatter-avg-sums.py   (one gloo rank: sum ==
     mean, nothing to see), or
     torchrun --nproc-per-node 2 fsdp2-gloo-reduce-scatter-avg-sums.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4 - 2.5
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard


def fsdp2_grad(x, reduce_dtype):
    torch.manual_seed(0)  # same initial weight on every rank
    model = nn.Linear(4, 2, bias=False)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
    model(x).pow(2).sum().backward()
    return model.weight.grad.full_tensor()


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    # The collective itself: AVG against SUM.
    inp = torch.arange(1.0, 1.0 + world) * (rank + 1)
    out = {}
    for op in ("SUM", "AVG"):
        out[op] = torch.zeros(1)
        dist.reduce_scatter_tensor(out[op], inp.clone(), op=getattr(dist.ReduceOp, op))
    print(f"[rank {rank}] torch {torch.__version__}: gloo reduce_scatter_tensor SUM -> {out['SUM'].item()}, "
          f"AVG -> {out['AVG'].item()} (mean {out['SUM'].item() / world})")

    # FSDP2: every rank its own input; the expected gradient is the ranks' mean.
    torch.manual_seed(100 + rank)
    x = torch.randn(3, 4)
    xs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(xs, x)
    torch.manual_seed(0)
    ref = nn.Linear(4, 2, bias=False)
    grads = []
    for xi in xs:
        ref.zero_grad()
        ref(xi).pow(2).sum().backward()
        grads.append(ref.weight.grad.clone())
    expected = torch.stack(grads).mean(0)
    for reduce_dtype in (None, torch.float32, torch.float16):
        got = fsdp2_grad(x, reduce_dtype)
        err = (got - expected).abs().max().item()
        ratio = (got.norm() / expected.norm()).item()
        verdict = "ok (mean over ranks)" if err < 1e-2 * expected.abs().max().item() else "WRONG"
        print(f"[rank {rank}] reduce_dtype={reduce_dtype}: FSDP2 grad {got.flatten().tolist()}\n"
              f"[rank {rank}]    expected mean          {expected.flatten().tolist()}\n"
              f"[rank {rank}]    |FSDP2|/|mean| = {ratio:.3f}, max diff {err:.3g}: {verdict}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
