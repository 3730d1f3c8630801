"""Finding fsdp2-clip-inf-norm-empty-local-shard (torch 2.13.0).

FSDP2 shards each parameter on dim 0; a parameter with fewer rows than ranks
(a Linear(3, 1)'s weight, a bias of one element) leaves some ranks an empty
local shard. torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm,
norm_type=inf) (and get_total_norm) then raises on those ranks, with foreach
on, off or left to torch:

  RuntimeError: _foreach_norm cannot compute the infinity norm on an empty
  tensor because the operation does not have an identity
  (foreach=False: linalg.vector_norm cannot compute the inf norm on an empty tensor ...)

while the ranks whose shards are all non-empty go on into the norm's
all-reduce and wait there for ever (this script stops them first).

Expected (clip_grad_norm_ / get_total_norm docstrings): the inf norm of
all gradients viewed as one vector, the same on every rank; a rank that
holds no element of a gradient contributes nothing (max over |g| >= 0: an
empty shard's identity is 0), as single-process clip_grad_norm_ gives and as
norm types 1, 2 and 3 do here.

Root cause: DTensor's norm runs the local op on each local shard
(_foreach_norm / linalg.vector_norm with ord=inf), and both refuse an empty
tensor (the foreach check came with pytorch#173238); the Partial("max")
reduction that follows would be right.

Run: torchrun --nproc-per-node 2 fsdp2-clip-inf-norm-empty-local-shard.py
"""

import math
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))  # the second weight: 1 row
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    model(torch.randn(2, 4)).pow(2).sum().backward()
    empty = [n for n, p in model.named_parameters() if not p.grad.to_local().numel()]
    print(f"rank {rank}: empty local gradient shards: {empty}", flush=True)

    # every rank first tries the local part alone: a rank must not enter the
    # all-reduce if another one raises before it
    local_ok = True
    try:
        torch.nn.utils.get_total_norm([p.grad.to_local() for p in model.parameters()], math.inf)
    except RuntimeError as e:
        local_ok = False
        print(f"rank {rank}: the local inf norm raises: {e}", flush=True)
    ok = torch.tensor([int(local_ok)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item():
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, math.inf)
        print(f"rank {rank}: total inf norm {total.full_tensor().item():.6g} (no rank has an empty shard here)", flush=True)
    elif not local_ok:
        try:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, math.inf)
        except RuntimeError as e:
            print(f"rank {rank}: clip_grad_norm_(norm_type=inf) raised: {e}", flush=True)
            print("FINDING REPRODUCED: inf norm with an empty local shard raises", flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown can abort a rank now and then


if __name__ == "__main__":
    main()
