"""Finding tp-colwise-size-one-out-features-view-backward (torch 2.13.0).

Tensor parallelism on a tp mesh dim of size 1 (a (dp, tp) = (2, 1) mesh, as
a job whose TP degree is 1 builds it): ColwiseParallel on a Linear with
out_features 1. The forward runs; the backward raises on every rank,
whether or not fully_shard(mesh=mesh["dp"]) wraps the model:

  RuntimeError: This operation would remove or reshape sharded dimension 1,
  which requires redistribution. Please redistribute the input first.
  (Sharding propagation failed for aten.view.default(Spec(f32[1, 1](S(1))), [1]) on DeviceMesh((tp=1)))

Expected: the model trains as single-process training does (ColwiseParallel
documents sharding a Linear's weight and bias on dim 0; DTensor allows a
mesh dim of size 1 and an uneven or size-1 tensor dim). With out_features 2
it does.

Root cause: the bias gradient is the output gradient summed over the batch,
a [1, 1] DTensor with Shard(1) over tp, viewed as [1]. DTensor's view
sharding propagation (_view_ops) treats the size-1 dim as one the view
removes, and refuses to drop a sharded dim instead of mapping it to the
output's dim 0.

Finding: tp-colwise-size-one-out-features-view-backward
Run: torchrun --nproc-per-node 2 tp-colwise-size-one-out-features-view-backward.py
Also: python tp-colwise-size-one-out-features-view-backward.py (one rank, a (1, 1) mesh)
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

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


def backward_error(mesh, out_features: int, fsdp: bool) -> str | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, out_features)).to(DEVICE)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    if fsdp:
        fully_shard(model, mesh=mesh["dp"])
    x = torch.randn(4, 1, device=DEVICE) * (dist.get_rank() + 1)
    try:
        model(x).pow(2).sum().backward()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def main():
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(DEVICE.type, (world, 1), mesh_dim_names=("dp", "tp"))
    errors = {(n, fsdp): backward_error(mesh, n, fsdp) for n in (1, 2) for fsdp in (False, True)}
    failed = [f"out_features {n}{' + fully_shard' if fsdp else ''}: {e}" for (n, fsdp), e in errors.items() if e]
    deviation = f"rank {rank}: backward raised ({'; '.join(failed)})" if failed else None
    finish(deviation, "backward ran on every rank, out_features 1 and 2, with and without fully_shard")


if __name__ == "__main__":
    main()
