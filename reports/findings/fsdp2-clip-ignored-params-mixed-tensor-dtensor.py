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

Run: torchrun --nproc-per-node 2 fsdp2-clip-ignored-params-mixed-tensor-dtensor.py
"""

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
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ignored = model[1].weight
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), ignored_params={ignored})
    model(torch.randn(2, 4) * (1 + rank)).pow(2).sum().backward()
    dist.all_reduce(ignored.grad)  # FSDP leaves it to the user: averaged
    ignored.grad /= world
    for foreach in (None, False):
        try:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
            print(f"rank {rank}: foreach={foreach}: total norm {total.full_tensor().item():.6g}", flush=True)
        except RuntimeError as e:
            print(f"rank {rank}: foreach={foreach}: clip_grad_norm_ raised: {str(e).splitlines()[0]}", flush=True)
            print("FINDING REPRODUCED: clip_grad_norm_ over fully_shard's ignored and sharded parameters raises", flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
