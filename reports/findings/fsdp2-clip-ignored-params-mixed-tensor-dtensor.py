"""Finding fsdp2-clip-ignored-params-mixed-tensor-dtensor (torch 2.13.0).

fully_shard(..., ignored_params={p}) leaves p a plain torch.Tensor while every
other parameter becomes a DTensor. torch.nn.utils.clip_grad_norm_ over
model.parameters() (the documented way to clip FSDP2 gradients, torchtitan's)
then raises on every rank:

  RuntimeError: aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor,
  need to convert all torch.Tensor to DTensor before calling distributed operators!
  (foreach=False: the same from aten.mul_.Tensor, when scaling)

get_total_norm(grads) does the same. Nothing in fully_shard's ignored_params or
clip_grad_norm_'s docstrings says that the two do not compose; the user
averages an ignored parameter's gradient (FSDP does not reduce it) and
expects the norm of all gradients.

Expected: the single-process total norm of every gradient (the ignored one
counted once) on every rank.

Root cause: torch.nn.utils.clip_grad._get_total_norm groups gradients by
(device, dtype) only and stacks their norms together: a DTensor norm and a
plain one meet in one foreach / stack call (the same grouping behind the
mixed-mesh failure, pytorch#180346).

Finding: fsdp2-clip-ignored-params-mixed-tensor-dtensor
Run: python fsdp2-clip-ignored-params-mixed-tensor-dtensor.py
Run: torchrun --nproc-per-node 2 fsdp2-clip-ignored-params-mixed-tensor-dtensor.py
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
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    xs = [torch.randn(2, 4) * (1 + r) for r in range(world)]  # each rank its own batch
    reference = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reference.load_state_dict(model.state_dict())
    for x in xs:
        reference(x).pow(2).sum().div(world).backward()  # FSDP averages the ranks' gradients
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    ignored = model[1].weight
    fully_shard(model, mesh=init_device_mesh(DEVICE.type, (world,)), ignored_params={ignored})
    model(xs[rank].to(DEVICE)).pow(2).sum().backward()
    dist.all_reduce(ignored.grad)  # FSDP leaves an ignored parameter's gradient to the user: averaged
    ignored.grad /= world
    deviation = None
    for foreach in (None, False):
        try:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, foreach=foreach)
            total = total.full_tensor().item() if hasattr(total, "full_tensor") else total.item()
            print(f"rank {rank}: foreach={foreach}: total norm {total:.6g}, single process {expected:.6g}", flush=True)
            if not math.isclose(total, expected, rel_tol=1e-4):
                deviation = deviation or f"foreach={foreach}: clip_grad_norm_ returned {total:.6g}, single-process {expected:.6g}"
        except RuntimeError as e:
            print(f"rank {rank}: foreach={foreach}: clip_grad_norm_ raised: {str(e).splitlines()[0]}", flush=True)
            deviation = deviation or f"foreach={foreach}: clip_grad_norm_ over ignored and sharded parameters raised: {str(e).splitlines()[0]}"
    finish(deviation, f"clip_grad_norm_ returned the single-process total norm {expected:.6g} on every rank")


if __name__ == "__main__":
    main()
