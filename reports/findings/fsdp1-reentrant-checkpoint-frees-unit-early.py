"""Finding fsdp1-reentrant-checkpoint-frees-unit-early (torch 2.13.0).

The reentrant checkpoint (checkpoint_wrapper's CheckpointImpl.REENTRANT,
torch.utils.checkpoint(use_reentrant=True)) of a region inside an FSDP1
unit whose other parameters the backward still needs raises in backward:

  RuntimeError: setStorage: sizes [4, 4], strides [4, 1], storage offset 0,
  and itemsize 4 requiring a storage size of 64 are out of bounds for
  storage of size 0

(both use_orig_params). The reentrant backward runs the region's backward
as a nested autograd graph task; on exit it flushes the flat parameter's
AccumulateGrad, which fires FSDP1's post-backward hook: the unit reshards
(frees its unsharded flat parameter) while the outer backward still has the
unit's other parameters (lin here) to differentiate. The non-reentrant
variant trains; so does the same model without AC.

Where the parameter that backward reads after the flush is an existing
view rather than one FSDP re-creates, nothing raises: the recompute of an
earlier reentrant region of the same unit (two regions, first and second,
in one unit) reads the freed storage directly. On CPU the tanh kernel then
reads freed memory (oneMKL: "Parameter 2 was incorrect on entry to vsTanh"
on stderr, or a segfault): the step silently writes garbage (first.weight
-1.2e32 instead of 0.303 after one SGD step, torch 2.13.0, torchrun 2).

Expected: the same gradients as without checkpointing.

Finding: fsdp1-reentrant-checkpoint-frees-unit-early
Run: torchrun --nproc-per-node 2 fsdp1-reentrant-checkpoint-frees-unit-early.py
Not shown by: python fsdp1-reentrant-checkpoint-frees-unit-early.py: FSDP1 does not shard on one rank (nothing is freed)
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class Region(nn.Module):
    def __init__(self):
        super().__init__()
        self.v = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return torch.tanh(x * self.v)


class Model(nn.Module):
    def __init__(self, impl):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.region = Region() if impl is None else checkpoint_wrapper(Region(), checkpoint_impl=impl)

    def forward(self, x):
        return self.region(self.lin(x))


def train(impl, use_orig_params):
    torch.manual_seed(0)
    model = FSDP(Model(impl), device_id=torch.device("cpu"), use_orig_params=use_orig_params)  # one unit: the root
    try:
        model(torch.randn(3, 4, requires_grad=True)).pow(2).sum().backward()
        return None
    except RuntimeError as e:
        return str(e).splitlines()[0]


class Leaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((4, 4), 0.3))

    def forward(self, x):
        return x + 0.5 * torch.tanh(self.weight).mean()


class TwoRegions(nn.Module):
    """Two reentrant regions in one unit (the root): the second's nested
    backward flushes the flat parameter; the first's recompute reads it."""

    def __init__(self, impl):
        super().__init__()
        wrap = (lambda m: m) if impl is None else (lambda m: checkpoint_wrapper(m, checkpoint_impl=impl))
        self.first, self.second = wrap(Leaf()), wrap(Leaf())

    def forward(self, x):
        return self.second(self.first(x))


def step_two_regions(impl):
    """One SGD step; the parameters after it (full), or the error."""
    model = FSDP(TwoRegions(impl), device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x = torch.randn(3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    try:
        model(x).pow(2).sum().backward()
        opt.step()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    with FSDP.summon_full_params(model):
        return {n.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", ""): p.detach().clone()
                for n, p in model.named_parameters()}


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    if dist.get_world_size() < 2:
        print("needs 2 ranks (FSDP1 does not shard on one): torchrun --nproc-per-node 2 ...", flush=True)
    reproduced = []
    for uop in (False, True):
        for impl in (None, CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT):
            err = train(impl, uop)
            if dist.get_rank() == 0:
                name = "no AC" if impl is None else impl.name
                print(f"use_orig_params={uop} {name}: " + ("backward ok" if err is None else f"backward raised {err}"), flush=True)
            if impl is CheckpointImpl.REENTRANT and err is not None:
                reproduced.append(f"use_orig_params={uop}: backward raised {err}")
    plain, reentrant = step_two_regions(None), step_two_regions(CheckpointImpl.REENTRANT)
    if isinstance(reentrant, str):
        reproduced.append(f"two regions: backward raised {reentrant}")
    else:
        for n, want in plain.items():
            if dist.get_rank() == 0:
                print(f"two regions, {n} after one step: no AC {want.flatten()[0].item():.4g}, REENTRANT {reentrant[n].flatten()[0].item():.4g}", flush=True)
            if not torch.allclose(reentrant[n], want):
                reproduced.append(f"two regions: {n} after one step differs from no AC by {(reentrant[n] - want).abs().max().item():.3g} (nothing raised)")
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"DEVIATION: the reentrant checkpoint inside an FSDP1 unit frees the unit before its backward ends: {'; '.join(reproduced)}"
              if reproduced else "AS SPECIFIED: training with the reentrant checkpoint inside the unit runs as without it", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
