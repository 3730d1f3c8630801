"""Finding fsdp1-shard-grad-op-unit-outside-backward-stays-unsharded (torch 2.13.0).

Under ShardingStrategy.SHARD_GRAD_OP, an FSDP1 unit that takes no part in
the backward (its parameters are frozen and nothing before it requires
grad, so neither its pre- nor its post-backward hook runs) keeps its
unsharded flat parameter after the backward and across iterations: the next
forward issues no all-gather for it. The final callback's catch-all reshard
sees the flat parameter already pointing at its local shard (the
non-freeing reshard after forward) and returns without freeing.

Expected (ShardingStrategy docstring: SHARD_GRAD_OP "parameters are sharded
outside computation ... only reshards them after the backward
computation"): the unit's parameters freed once the backward is done, and
all-gathered again in the next forward, as FULL_SHARD and the other units
are.

A plain `python` run is a fake world of 2 (structure only); torchrun runs gloo.

Finding: fsdp1-shard-grad-op-unit-outside-backward-stays-unsharded
Run: python fsdp1-shard-grad-op-unit-outside-backward-stays-unsharded.py
Run: torchrun --nproc-per-node 2 fsdp1-shard-grad-op-unit-outside-backward-stays-unsharded.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.utils._python_dispatch import TorchDispatchMode


class AllGathers(TorchDispatchMode):
    """The all-gathers issued under it, by the numel they gather."""

    def __init__(self):
        super().__init__()
        self.numels = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "allgather" in str(func.overloadpacket):
            ts = [t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
            self.numels.append(sum(t.numel() for t in ts[:-1]))
        return func(*args, **(kwargs or {}))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(4, 4)  # first: its input never requires grad
        self.head = nn.Linear(4, 6)  # another size: its all-gather is told apart by numel

    def forward(self, x):
        return self.head(self.frozen(x))


def main():
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch.manual_seed(0)
    model = Model()
    for p in model.frozen.parameters():
        p.requires_grad_(False)
    wrap = {model.frozen, model.head}
    fsdp = FSDP(model, auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or module in wrap,
                sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, device_id=torch.device("cpu"))
    x = torch.randn(2, 4)
    world = dist.get_world_size()
    padded = {"frozen": -(-20 // world) * world, "head": -(-30 // world) * world}  # the flat parameters, padded
    deviation = None
    for it in range(3):
        with AllGathers() as ag:
            out = fsdp(x)
        out.sum().backward()
        seen = {name: ag.numels.count(n) for name, n in padded.items()}
        print(f"[rank {dist.get_rank()}] iteration {it}: forward all-gathers per unit {seen}"
              f" (expected 1 each: SHARD_GRAD_OP shards the parameters outside computation)")
        missing = [name for name, n in seen.items() if n != 1]
        if missing and deviation is None:
            deviation = (f"iteration {it}: the forward all-gathers {missing} {[seen[m] for m in missing]} time(s), not once:"
                         " the unit outside the backward was never resharded")
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"DEVIATION: {deviation}" if deviation else
              "AS SPECIFIED: every unit is all-gathered once in each forward (resharded after each backward)", flush=True)
    os._exit(0)

if __name__ == "__main__":
    main()
