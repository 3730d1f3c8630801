"""Finding fsdp2-tp-empty-local-shard-chunk-cat (torch 2.13.0).

Tensor parallelism + FSDP2: ColwiseParallel on a Linear whose out_features
(1) is smaller than the tp dim (2) leaves tp rank 1 an empty TP-local
weight and bias (DTensor shards as torch.chunk does: uneven and empty pieces
are allowed). fully_shard(mesh=mesh["dp"]) accepts it and forward works,
but the backward raises on the ranks with the empty piece, in FSDP2's
reduce-scatter copy-in:

  RuntimeError: _chunk_cat expects non-empty tensor

Expected: TP + FSDP2 trains such a model as single-process training does
(ColwiseParallel and DTensor accept the uneven sharding; fully_shard
documents no restriction on the TP-local size; test_fully_shard_training.py
TestFullyShard2DTraining trains 2-D models), the ranks with the empty piece
contributing an empty gradient shard.

Root cause: FSDP2's foreach_reduce copies the unsharded (here TP-local)
gradients into the reduce-scatter input with torch._chunk_cat, which refuses
an empty tensor; an empty TP-local gradient reaches it.

Finding: fsdp2-tp-empty-local-shard-chunk-cat
Run: torchrun --nproc-per-node 2 fsdp2-tp-empty-local-shard-chunk-cat.py
Not shown by: python fsdp2-tp-empty-local-shard-chunk-cat.py: a (dp, tp) mesh needs 2 ranks at least
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
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
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        finish(None, "one rank: no (dp, tp) mesh to test (run with torchrun --nproc-per-node 2)")
    mesh = init_device_mesh(DEVICE.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(DEVICE)  # out_features 1 < tp 2
    parallelize_module(model, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
    fully_shard(model, mesh=mesh["dp"])
    x = torch.randn(2, 3, device=DEVICE)
    error = None
    try:
        model(x).pow(2).sum().backward()
    except RuntimeError as e:
        error = str(e).splitlines()[0]
    local = tuple(model.weight.to_local().shape)
    deviation = f"rank {rank} (local weight {local}): backward raised {error}" if error else None
    finish(deviation, "backward ran on every rank")


if __name__ == "__main__":
    main()
