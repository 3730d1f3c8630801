"""Finding fsdp2-tp-uneven-strided-full-tensor-wrong (torch 2.9.1).

Tensor parallelism + FSDP2 on a (2, 2) (dp, tp) mesh: a ColwiseParallel
Linear(1, 2) has a (2, 1) weight; TP gives each tp rank one row, and FSDP2
shards that row over dp unevenly (one row over two ranks: placements
(_StridedShard(0, split_factor=2), Shard(0)), dp rank 1's piece empty).
On 2.9.1, weight.full_tensor() right after fully_shard is not the weight
the model had before: the unsharded rows come back misplaced or mixed up.
2.8.0 and 2.10.0 on give the weight back.

Expected (DTensor.full_tensor docstring: "Return the full tensor of this
DTensor"): full_tensor() equals the unsharded parameter.

Finding: fsdp2-tp-uneven-strided-full-tensor-wrong
Run: torchrun --nproc-per-node 4 fsdp2-tp-uneven-strided-full-tensor-wrong.py
Not shown by: python fsdp2-tp-uneven-strided-full-tensor-wrong.py: a (dp, tp) mesh needs 4 ranks here
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


def main():
    init()
    world = dist.get_world_size()
    if world != 4:
        finish(None, f"{world} ranks: the (2, 2) mesh needs 4 (run with torchrun --nproc-per-node 4)")
    mesh = init_device_mesh(DEVICE.type, (2, 2), mesh_dim_names=("dp", "tp"))
    wrong = []
    for rows in (2, 3, 4, 6):  # out_features: 2 and 6 split unevenly over dp after tp, 4 evenly
        lin = nn.Linear(1, rows, bias=False).to(DEVICE)
        with torch.no_grad():
            lin.weight.copy_(torch.arange(1.0, rows + 1.0, device=DEVICE).view(rows, 1))
        want = lin.weight.detach().clone()
        parallelize_module(lin, mesh["tp"], ColwiseParallel())
        fully_shard(lin, mesh=mesh["dp"])
        got = lin.weight.full_tensor().detach()
        if not torch.equal(got, want):
            wrong.append(f"Linear(1, {rows}) ({lin.weight.placements}): full_tensor() {got.flatten().tolist()}, the weight {want.flatten().tolist()}")
    finish("; ".join(wrong) or None, "full_tensor() of each TP + FSDP2 weight is the weight")


if __name__ == "__main__":
    main()
