"""Finding fsdp2-tp-clip-mixed-meshes (torch 2.13.0).

Tensor parallelism + FSDP2 as torchtitan composes them: parallelize_module
over the "tp" dim of a (dp, tp) mesh, then fully_shard(mesh=mesh["dp"]).
A parameter a style touched becomes a DTensor on the 2-D (dp, tp) mesh; one
no style touched (a LayerNorm left out of the plan, a model's own scale)
a DTensor on the 1-D dp mesh. torch.nn.utils.clip_grad_norm_ over
model.parameters() then raises on every rank (foreach True or False):

  RuntimeError: All operands in aten.stack.default must have the same mesh,
  but got DeviceMesh((dp=..., tp=...)) and DeviceMesh((dp=...))

Expected (clip_grad_norm_ docstring): "The norm is computed over the norms
of the individual gradients of all parameters, as if the norms of the
individual gradients were concatenated into a single vector": the
single-process norm, the same on every rank.

Root cause: clip_grad._get_total_norm groups gradients by (device, dtype)
only and torch.stack()s the per-gradient norms, which stay DTensors on their
own meshes (pytorch#180346).

Finding: fsdp2-tp-clip-mixed-meshes
Run: torchrun --nproc-per-node 2 fsdp2-tp-clip-mixed-meshes.py
Run: torchrun --nproc-per-node 4 fsdp2-tp-clip-mixed-meshes.py
Not shown by: python fsdp2-tp-clip-mixed-meshes.py: a (dp, tp) mesh needs 2 ranks at least
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
    world = dist.get_world_size()
    if world < 2:
        finish(None, "one rank: no (dp, tp) mesh to test (run with torchrun --nproc-per-node 2 or 4)")
    mesh = init_device_mesh(DEVICE.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).to(DEVICE)
    reference = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).to(DEVICE)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 4, device=DEVICE)
    reference(x).pow(2).sum().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], 2.0).item()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(output_layouts=Replicate())})  # the LayerNorm: FSDP only
    fully_shard(model, mesh=mesh["dp"])
    meshes = sorted({str(p.device_mesh) for p in model.parameters()})
    model(x).pow(2).sum().backward()
    deviation = None
    for foreach in (False, True):
        try:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, 2.0, foreach=foreach)
            got = total.full_tensor().item() if hasattr(total, "full_tensor") else total.item()
            if abs(got - expected) > 1e-4 * expected:
                deviation = f"clip_grad_norm_(foreach={foreach}) returned {got:.6g}, single-process {expected:.6g}"
        except (RuntimeError, ValueError) as e:  # 2.8 raises the same message as a ValueError
            deviation = (f"clip_grad_norm_(foreach={foreach}) over gradients on meshes {meshes} raised: "
                         f"{str(e).splitlines()[0][:160]}")
            break
    finish(deviation, f"clip_grad_norm_ over gradients on meshes {meshes} returned the single-process norm {expected:.6g}")


if __name__ == "__main__":
    main()
