"""Finding tp-sequence-parallel-unfreezes-params (torch 2.13.0).

parallelize_module(model, tp_mesh, {"norm": SequenceParallel()}) on a
LayerNorm whose weight and bias are frozen (requires_grad=False) registers
them again as nn.Parameter(DTensor.from_local(...)) without their
requires_grad: both come back trainable, get gradients and move under the
optimizer. ColwiseParallel and RowwiseParallel keep requires_grad.

Expected: parallelizing a module changes how its parameters are laid out,
not whether they train (ColwiseParallel / RowwiseParallel pass
requires_grad=param.requires_grad; parallelize_module's docstring speaks of
sharding only).

Root cause: torch/distributed/tensor/parallel/style.py,
SequenceParallel._replicate_module_fn: torch.nn.Parameter(DTensor.from_local(param, ...))
with the default requires_grad=True.

Finding: tp-sequence-parallel-unfreezes-params
Run: torchrun --nproc-per-node 2 tp-sequence-parallel-unfreezes-params.py
Run: python tp-sequence-parallel-unfreezes-params.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

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
    mesh = init_device_mesh(DEVICE.type, (dist.get_world_size(),))
    model = nn.Sequential(nn.LayerNorm(4)).to(DEVICE)
    model[0].requires_grad_(False)
    parallelize_module(model, mesh, {"0": SequenceParallel()})
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    deviation = f"frozen parameters {trainable} are trainable after SequenceParallel" if trainable else None
    finish(deviation, "the frozen LayerNorm parameters stayed frozen")


if __name__ == "__main__":
    main()
