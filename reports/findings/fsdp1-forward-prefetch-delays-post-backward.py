"""Finding fsdp1-forward-prefetch-delays-post-backward (torch 2.13.0).

FSDP1 with forward_prefetch=True and backward_prefetch=BACKWARD_POST: from
the second iteration on (when forward prefetching starts), a unit's
post-backward hook runs only after the *previous* unit's gradient
computation, so BACKWARD_POST prefetches nothing (the next unit all-gathers
in its own pre-backward hook) and each unit's reduce-scatter waits for the
next unit's computation. Forward prefetching unshards the next unit inside
the current unit's pre-forward, and the unsharded views of its flat
parameter (whose backward gates its post-backward hook) are created there,
before the current unit's computation: autograd runs them after it.

Expected (BackwardPrefetch docstring): BACKWARD_POST "prefetches the next set
of parameters after the current set of parameters' gradient computation.
This overlaps the current reduce-scatter and the next gradient computation";
forward_prefetch concerns the forward only. Iteration 0 (no forward
prefetching yet) shows the promised order.

A plain `python` run is a fake world of 2 (structure only); torchrun runs gloo.

Finding: fsdp1-forward-prefetch-delays-post-backward
Run: python fsdp1-forward-prefetch-delays-post-backward.py
Run: torchrun --nproc-per-node 2 fsdp1-forward-prefetch-delays-post-backward.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils._python_dispatch import TorchDispatchMode

LOG = []


class Collectives(TorchDispatchMode):
    """Logs each all-gather and reduce-scatter, named by the unit whose numel it moves."""

    def __init__(self, by_numel):
        super().__init__()
        self.by_numel = by_numel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        ts = [t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
        if "allgather" in name:
            LOG.append(f"all-gather {self.by_numel.get(sum(t.numel() for t in ts[:-1]), '?')}")
        elif "reduce_scatter" in name:
            LOG.append(f"reduce-scatter {self.by_numel.get(sum(t.numel() for t in ts[1:]), '?')}")
        return func(*args, **(kwargs or {}))


def main():
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    world = dist.get_world_size()
    torch.manual_seed(0)
    dims = [(4, 4), (4, 6), (6, 8)]  # three units of different sizes
    layers = [nn.Linear(i, o) for i, o in dims]
    model = nn.Sequential(*layers)
    names = {id(m): f"layer{i}" for i, m in enumerate(layers)}
    for m in layers:  # fires once the layer's gradient computation is done
        m.register_full_backward_hook(lambda mod, gi, go: LOG.append(f"{names[id(mod)]} gradients computed"))
    by_numel = {-(-(i * o + o) // world) * world: f"layer{k}" for k, (i, o) in enumerate(dims)}
    fsdp = FSDP(model, auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, nn.Linear),
                sharding_strategy=ShardingStrategy.FULL_SHARD, backward_prefetch=BackwardPrefetch.BACKWARD_POST,
                forward_prefetch=True, device_id=torch.device("cpu"))
    x = torch.randn(2, 4, requires_grad=True)
    logs = []
    for it in range(2):
        out = fsdp(x)
        LOG.clear()
        with Collectives(by_numel):
            out.sum().backward()
        logs.append(list(LOG))
        if dist.get_rank() == 0:
            print(f"iteration {it} backward: {LOG}")
    deviation = None
    for it, log in enumerate(logs):
        # BACKWARD_POST: layer k's post-backward hook (its reduce-scatter, and the prefetch of layer k-1) runs
        # right after layer k's gradient computation, before layer k-1's
        for k in range(len(layers) - 1, 0, -1):
            rs, previous_done = f"reduce-scatter layer{k}", f"layer{k - 1} gradients computed"
            if log.index(rs) > log.index(previous_done):
                deviation = deviation or (f"iteration {it}: layer{k}'s post-backward hook ({rs!r}) runs after {previous_done!r},"
                                          f" so BACKWARD_POST prefetches nothing: {log}")
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"DEVIATION: {deviation}" if deviation else
              "AS SPECIFIED: in every iteration each layer's post-backward hook (reduce-scatter, BACKWARD_POST prefetch)"
              " runs before the previous layer's gradient computation", flush=True)
    os._exit(0)

if __name__ == "__main__":
    main()
