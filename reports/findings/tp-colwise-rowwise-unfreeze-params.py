"""Finding tp-colwise-rowwise-unfreeze-params (torch 2.8.0).

parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "1":
RowwiseParallel()}) on Linear layers whose weight and bias are frozen
(requires_grad=False) registers them again as nn.Parameter(DTensor) with
the default requires_grad=True: every frozen parameter comes back
trainable, gets a gradient and moves under the optimizer (2.8.0: TP-LAYOUT
and TP-PARITY in the release matrix). pytorch#171523 / PR #171709 made
distribute_module, ColwiseParallel and RowwiseParallel keep requires_grad
(SequenceParallel still does not: tp-sequence-parallel-unfreezes-params).

  2.8.0: ['0.weight', '0.bias', '1.weight', '1.bias'] trainable after parallelize_module
  2.12.1, 2.13.0, 2.14.1: none

Expected: parallelizing a module changes how its parameters are laid out,
not whether they train.

Finding: tp-colwise-rowwise-unfreeze-params
Run: torchrun --nproc-per-node 2 tp-colwise-rowwise-unfreeze-params.py
Run: python tp-colwise-rowwise-unfreeze-params.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(DEVICE)
    model.requires_grad_(False)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    deviation = f"frozen parameters {trainable} are trainable after ColwiseParallel / RowwiseParallel" if trainable else None
    finish(deviation, "the frozen Linear parameters stayed frozen")

if __name__ == "__main__":
    main()
