"""Finding: fsdp1-orig-params-unused-param-zero-grad

FSDP1 with use_orig_params=True: an original parameter that a step's forward
does not use, while another parameter of the same FSDP unit (FlatParameter) is
used, gets a zero gradient instead of None (on the rank whose shard holds it).
The optimizer, which with use_orig_params=True "runs on the original
parameters", then steps it: Adam's momentum moves a parameter that
single-process training (and FSDP2) leaves untouched. (_reset_is_grad_none in
the post-backward clears the None mask of every parameter that requires grad.)
Expected: the parameter's .grad stays None, as in single-process training; the
values after the step equal single-process training.

Run: python fsdp1-orig-params-unused-param-zero-grad.py
Run: torchrun --nproc-per-node 2 fsdp1-orig-params-unused-param-zero-grad.py
"""

import copy
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


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
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same model on every rank
    ref = TwoLayers()  # single-process training on every rank's data
    model = FSDP(copy.deepcopy(ref), use_orig_params=True, device_id=torch.device("cpu"))  # one unit: a and b
    opt, ropt = torch.optim.Adam(model.parameters(), lr=0.05), torch.optim.Adam(ref.parameters(), lr=0.05)
    for step, use_b in enumerate((True, False)):  # step 1 does not use b
        model.module.use_b = ref.use_b = use_b
        xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world)]
        model(xs[rank]).pow(2).sum().backward()
        (sum(ref(x).pow(2).sum() for x in xs) / world).backward()
        grad = model.module.b.weight.grad  # step 1: None expected
        for o in (opt, ropt):
            o.step()
            o.zero_grad(set_to_none=True)
    with FSDP.summon_full_params(model):
        diff = (model.module.b.weight - ref.b.weight).abs().max().item()
    finish((grad is not None or diff > 1e-6) and f"b, unused in step 1, has .grad {'None' if grad is None else 'zeros'} on rank {rank} "
           f"(rank 0 holds its shard), and after the step it differs from single-process training by {diff:.3g} (expected None and 0)",
           "the unused b kept .grad None and equals single-process training")


if __name__ == "__main__":
    main()
