"""Finding fsdp2-tp-empty-piece-full-tensor-hang (torch 2.13.0).

Tensor parallelism + FSDP2 on a (2, 2) (dp, tp) mesh: RowwiseParallel on a
Linear(1, 1) splits the weight's one column 1 / 0 over tp (tp rank 1 holds
an empty piece) and fully_shard(mesh=mesh["dp"]) its one row 1 / 0 over
dp. full_tensor() of that weight then returns on the tp ranks holding the
empty piece and never returns on the others (they wait in an all_gather;
this script gives up after 10 s). TP alone (no fully_shard) works.

Expected (DTensor.full_tensor docstring): "Return the full tensor of this
DTensor" on every rank - a collective every rank completes.

Root cause (not traced to the line): on the 2-D mesh the redistribute to
Replicate issues a different sequence of collectives on the ranks whose
local piece is empty than on the others, so their all_gathers
never pair up.

Finding: fsdp2-tp-empty-piece-full-tensor-hang
Run: torchrun --nproc-per-node 4 fsdp2-tp-empty-piece-full-tensor-hang.py
Not shown by: torchrun --nproc-per-node 2 fsdp2-tp-empty-piece-full-tensor-hang.py: a (1, 2) mesh shards nothing over dp
Not shown by: python fsdp2-tp-empty-piece-full-tensor-hang.py: a (dp, tp) mesh needs 4 ranks here
"""

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

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
    if world != 4:
        finish(None, f"{world} ranks: the (2, 2) mesh needs 4 (run with torchrun --nproc-per-node 4)")
    mesh = init_device_mesh(DEVICE.type, (2, 2), mesh_dim_names=("dp", "tp"))
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Linear(1, 1, bias=False).to(DEVICE)
    want = model.weight.detach().clone()
    parallelize_module(model, mesh["tp"], RowwiseParallel(input_layouts=Replicate()))
    fully_shard(model, mesh=mesh["dp"])
    local = tuple(model.weight.to_local().shape)
    # full_tensor() on a worker thread: the ranks report on the side group whether it returned within 10 s
    import threading

    done = []
    threading.Thread(target=lambda: done.append(model.weight.full_tensor()), daemon=True).start()
    for _ in range(100):
        if done:
            break
        threading.Event().wait(0.1)
    flags = [None] * world
    dist.all_gather_object(flags, (rank, local, bool(done)), group=side)
    stuck = [(r, s) for r, s, ok in flags if not ok]
    deviation = None
    if stuck:
        deviation = f"full_tensor() of a (Shard(0), Shard(1)) weight never returned on ranks (rank, local shape) {stuck}; it did on the others"
    elif not torch.equal(done[0].cpu(), want.cpu()):
        deviation = "full_tensor() returned other values than the unsharded weight"
    if dist.get_rank() == 0:
        print(f"DEVIATION: {deviation}" if deviation else "AS SPECIFIED: full_tensor() returned the unsharded weight on every rank", flush=True)
    os._exit(0)  # the stuck all_gather never ends: no barrier on the default group


if __name__ == "__main__":
    main()
