"""Finding: fsdp2-one-rank-shard-dim-collectives

FSDP2 on a mesh whose shard dim has one rank (HSDP's (n, 1) layout, the
DDP-like one; or one rank in all) still runs its collectives over that dim:
an all-gather of every parameter group in forward and a reduce-scatter of
every gradient in backward, each over a group of one rank. They move nothing.
torch 2.9 skips the all-gather when the shard group has one rank
(pytorch#160135), 2.10 the reduce-scatter too (#162021).
Expected: on a one-rank shard dim no all-gather and no reduce-scatter: the
(n, 1) layout behaves like DDP, gradients all-reduced over the replicate dim
only.

Run: torchrun --nproc-per-node 2 fsdp2-one-rank-shard-dim-collectives.py
Run: python fsdp2-one-rank-shard-dim-collectives.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.4, 2.5
    from torch.distributed._composable.fsdp import fully_shard


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
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(2, 4) * (1 + dist.get_rank())
    with CommDebugMode() as comm:
        model(x).sum().backward()
    counts = {str(op).split(".")[-1]: k for op, k in comm.get_comm_counts().items()}
    over_one = {op: k for op, k in counts.items() if "gather" in op or "reduce_scatter" in op}
    bad = (f"mesh ({n}, 1): {over_one} over the one-rank shard dim in one forward and backward "
           f"(all collectives: {counts}; expected no all-gather and no reduce-scatter)") if over_one else None
    finish(bad, f"mesh ({n}, 1): no all-gather or reduce-scatter over the one-rank shard dim (collectives: {counts})")


if __name__ == "__main__":
    main()
