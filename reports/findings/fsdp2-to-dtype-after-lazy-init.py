"""Finding fsdp2-to-dtype-after-lazy-init (torch 2.13.0).

fully_shard(model), then FSDPModule.unshard() (which runs FSDP's lazy init;
a first forward does the same), then model.to(torch.float64): the parameters
are float64 DTensors, as FSDPModule._apply promises by resetting every
sharded parameter, but the next forward's all-gather raises

  RuntimeError: Expected out tensor to have dtype double, but got float instead

The same to() before lazy init works (upstream test_to_float64_after_init).

Root cause: FSDPParam.init_dtype_attrs records orig_dtype once, at lazy init;
FSDPModule._apply calls reset_sharded_param but not init_dtype_attrs, so the
all-gather output is still allocated as float32.

Finding: fsdp2-to-dtype-after-lazy-init
Run: torchrun --nproc-per-node 2 fsdp2-to-dtype-after-lazy-init.py
Run: python fsdp2-to-dtype-after-lazy-init.py
"""
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn

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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main():
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).to(DEVICE)
    mesh = init_device_mesh(DEVICE.type, (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.unshard()  # lazy init (as a first forward would)
    model.to(torch.float64)
    kept = all(hasattr(p, "device_mesh") and p.dtype == torch.float64 for p in model.parameters())
    print(f"rank {rank}: after to(float64) every parameter is a float64 DTensor: {kept}", flush=True)
    deviation = None
    try:
        model(torch.randn(2, 3, dtype=torch.float64, device=DEVICE)).sum().backward()
    except RuntimeError as e:
        deviation = f"rank {rank}: forward after unshard() then to(float64) raised RuntimeError: {str(e).splitlines()[0][:120]}"
    finish(deviation, "forward and backward run in float64 after to(float64), lazy init or not")


if __name__ == "__main__":
    main()
