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

Finding: fsdp2-clip-inf-norm-empty-local-shard
Run: torchrun --nproc-per-node 2 fsdp2-clip-inf-norm-empty-local-shard.py
Not shown by: python fsdp2-clip-inf-norm-empty-local-shard.py: one rank holds every row, so no local shard is empty
"""

import math
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

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
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))  # the second weight: 1 row
    x = torch.randn(2, 4)
    reference = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    reference.load_state_dict(model.state_dict())
    reference(x).pow(2).sum().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], math.inf).item()
    fully_shard(model, mesh=init_device_mesh(DEVICE.type, (world,)))
    model(x.to(DEVICE)).pow(2).sum().backward()
    empty = [n for n, p in model.named_parameters() if not p.grad.to_local().numel()]
    print(f"rank {rank}: empty local gradient shards: {empty}", flush=True)

    # every rank first tries the local part alone: a rank must not enter the
    # norm's all-reduce if another one raises before it (it would wait for ever)
    error = None
    try:
        torch.nn.utils.get_total_norm([p.grad.to_local() for p in model.parameters()], math.inf)
    except RuntimeError as e:
        error = str(e).splitlines()[0]
        print(f"rank {rank}: the local inf norm raises: {error}", flush=True)
    ok = torch.tensor([int(error is None)], device=DEVICE)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    deviation = None
    if ok.item():
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, math.inf).full_tensor().item()
        print(f"rank {rank}: total inf norm {total:.6g}, single process {expected:.6g}", flush=True)
        if not math.isclose(total, expected, rel_tol=1e-5):
            deviation = f"rank {rank}: clip_grad_norm_(norm_type=inf) returned {total:.6g}, single-process {expected:.6g}"
    elif error is not None:
        try:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, math.inf)
            deviation = f"rank {rank}: the local inf norm of an empty shard raises ({error})"
        except RuntimeError as e:
            deviation = f"rank {rank} (empty shards {empty}): clip_grad_norm_(norm_type=inf) raised: {str(e).splitlines()[0]}"
    finish(deviation, f"clip_grad_norm_(norm_type=inf) returned the single-process inf norm {expected:.6g} on every rank")


if __name__ == "__main__":
    main()
