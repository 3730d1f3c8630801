"""Finding: fsdp2-gloo-reduce-scatter-avg-sums

FSDP2 (fully_shard) on a gloo process group with more than one rank: after
backward each parameter's gradient is the SUM of the ranks' gradients, not
their mean, whenever the reduction runs in float32 or bfloat16 (the default,
and MixedPrecisionPolicy(reduce_dtype=float32)). A float16 reduce_dtype is
averaged correctly. Expected (fully_shard / MixedPrecisionPolicy docs, as DDP
does): gradients are reduce-scattered and averaged over the data-parallel
ranks. Root cause (torch 2.8.0): _fsdp_collectives._get_gradient_divide_factors
returns ReduceOp.AVG for a float32/bfloat16 reduce_dtype whatever the backend;
the 2.8.0 gloo process group accepts ReduceOp.AVG but its reduce_scatter
returns the plain sum (the script also checks dist.reduce_scatter_tensor
itself). torch 2.9.1 and 2.13.0 average in gloo's reduce_scatter.

Run: torchrun --nproc-per-node 2 fsdp2-gloo-reduce-scatter-avg-sums.py
Not shown by: python fsdp2-gloo-reduce-scatter-avg-sums.py: on one rank the sum is the mean
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
    out = torch.zeros(1)  # the collective itself: AVG must be the mean
    dist.reduce_scatter_tensor(out, torch.arange(1.0, 1.0 + world) * (rank + 1), op=dist.ReduceOp.AVG)
    mean = (rank + 1) * sum(range(1, world + 1)) / world
    if abs(out.item() - mean) > 1e-6:
        wrong.append(f"gloo reduce_scatter_tensor(op=AVG) gave {out.item()}, the mean is {mean}")
    torch.manual_seed(100 + rank)
    x = torch.randn(3, 4)  # every rank its own input; the expected gradient is the ranks' mean
    xs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(xs, x)
    torch.manual_seed(0)
    ref = nn.Linear(4, 2, bias=False)
    (sum(ref(xi).pow(2).sum() for xi in xs) / world).backward()
    for reduce_dtype in (None, torch.float32, torch.float16):
        torch.manual_seed(0)  # the reference's initial weight on every rank
        model = nn.Linear(4, 2, bias=False)
        fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
        model(x).pow(2).sum().backward()
        ratio = (model.weight.grad.full_tensor().norm() / ref.weight.grad.norm()).item()
        if abs(ratio - 1) > 1e-2:
            wrong.append(f"reduce_dtype={reduce_dtype}: the gradient is {ratio:.3f} times the ranks' mean")
    finish(wrong and f"FSDP2 on gloo does not average gradients: {'; '.join(wrong)}", "FSDP2 on gloo averages the gradients over the ranks")


if __name__ == "__main__":
    main()
