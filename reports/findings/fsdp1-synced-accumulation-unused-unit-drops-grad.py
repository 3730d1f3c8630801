"""Finding: fsdp1-synced-accumulation-unused-unit-drops-grad

Gradient accumulation with synchronization on every microbatch (several
backward passes before one optimizer step, without no_sync) under FSDP1 with
use_orig_params=False: a unit whose parameters get a gradient in the first
microbatch, and whose forward runs in the second without reading them (here
the root unit, whose only parameter belongs to a submodule the second forward
passes over), ends the step with no gradient at all (its FlatParameter's .grad
is None): the first microbatch's reduced gradient is dropped, and the
optimizer skips the parameter. With the parameter read in both microbatches
the accumulated gradient is right. (use_orig_params=True drops the
FlatParameter's gradient alike, but the original parameters' .grad views keep
it.) Expected (FullyShardedDataParallel.no_sync docstring: accumulation
without no_sync is supported, at the cost of communication; nn.Module
semantics): the gradient after several backward passes is their sum.

Run: torchrun --nproc-per-node 2 fsdp1-synced-accumulation-unused-unit-drops-grad.py
Not shown by: python fsdp1-synced-accumulation-unused-unit-drops-grad.py: with one rank FSDP1 uses NO_SHARD, which keeps no separate sharded gradient
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


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


class Head(nn.Module):
    """A module with its own parameter, not wrapped: it joins the root unit."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        return x @ self.weight.t()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)  # its own unit (ModuleWrapPolicy({nn.Linear}))
        self.head = Head()  # the root unit's only parameter
        self.skip_head = False

    def forward(self, x):
        h = self.body(x)
        return h if self.skip_head else self.head(h)


def main():
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    wrong = []
    for skip_second in (True, False):  # False: the control, the head read in both microbatches
        torch.manual_seed(0)
        ref = Model()  # single-process reference
        model = Model()
        model.load_state_dict(ref.state_dict())
        fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=False, device_id=torch.device("cpu"))
        for k in range(2):  # two microbatches, each rank its own data, synchronized every time
            model.skip_head = ref.skip_head = skip_second and k == 1
            xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * k + r)) for r in range(world)]
            fsdp(xs[rank]).pow(2).sum().backward()
            (sum(ref(x).pow(2).sum() for x in xs) / world).backward()
        # the root's FlatParameter holds head.weight alone: its .grad is this rank's shard (padded)
        got = fsdp._flat_param.grad
        what = f"head {'skipped' if skip_second else 'read'} in microbatch 2"
        if got is None:
            wrong.append(f"{what}: the root unit's gradient (head.weight's) is None after the step's two backwards")
            continue
        n = got.numel()
        want = ref.head.weight.grad.flatten()[rank * n: (rank + 1) * n]
        want = torch.cat([want, torch.zeros(n - want.numel())])
        if not torch.allclose(got, want, atol=1e-5):
            wrong.append(f"{what}: head.weight's accumulated gradient differs from single-process training by "
                         f"{float((got - want).abs().max()):.3g}")
    finish(wrong and "; ".join(wrong),
           "every accumulated gradient equals single-process training's, the head skipped in microbatch 2 or not")


if __name__ == "__main__":
    main()
