"""Finding fsdp1-orig-params-unused-param-zero-grad (torch 2.13.0, 2.14.1).

FSDP1 with use_orig_params=True: an original parameter that a step's forward
does not use, while another parameter of the same FSDP unit (FlatParameter)
is used, gets a zero gradient instead of None (on the rank whose shard holds
it). The optimizer, which with use_orig_params=True "runs on the original
parameters", then steps it: Adam's and SGD's momentum and AdamW's weight
decay move a parameter that single-process training (and FSDP2) leaves
untouched, and its optimizer state advances. (_reset_is_grad_none in the
post-backward clears the None mask of every parameter that requires grad,
on the assumption that it received a gradient.)

Expected: the parameter's .grad stays None, as in single-process training
(FSDP docstring, use_orig_params: the optimizer step runs on the original
parameters); the values after the step equal single-process training.

Run: python fsdp1-orig-params-unused-param-zero-grad.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp1-orig-params-unused-param-zero-grad.py
"""

import copy
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.use_b = True

    def forward(self, x):
        x = self.a(x)
        return self.b(x) if self.use_b else x


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = TwoLayers()  # single-process training on every rank's data
    model = FSDP(copy.deepcopy(ref), use_orig_params=True, device_id=torch.device("cpu"))  # one unit: a and b
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.05)
    for step, use_b in enumerate((True, False)):  # step 1 does not use b
        model.module.use_b = ref.use_b = use_b
        xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world)]
        model(xs[rank]).pow(2).sum().backward()
        (sum(ref(x).pow(2).sum() for x in xs) / world).backward()
        if not use_b:
            g = model.module.b.weight.grad
            held = model.module.b.weight.numel() > 0  # this rank's shard holds part of b.weight
            print(f"[rank {rank}] step {step} (b unused): b.weight.grad is "
                  f"{'None' if g is None else 'zeros' if not g.any() else 'nonzero'}"
                  f"{'' if held else ' (not in this rank shard)'}; single-process training: {ref.b.weight.grad}")
        opt.step()
        ropt.step()
        opt.zero_grad(set_to_none=True)
        ropt.zero_grad(set_to_none=True)
    with FSDP.summon_full_params(model):
        diff = (model.module.b.weight - ref.b.weight).abs().max().item()
    print(f"[rank {rank}] after step 1, b.weight differs from single-process training by {diff:.3g} (expected 0)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
