"""Finding: fsdp2-split-tie-managed-twice

A Parameter tied between two modules that are sharded by two separate
fully_shard calls (fully_shard(model.a), fully_shard(model.b)) is taken by
both groups: each makes its own sharded copy and its own all-gather and
reduce-scatter for it. No error is raised and the tie is silently managed
twice. torch 2.13 rejects the case at the first forward with a ValueError that
names the parameter and prescribes fully_shard([a, b]). Expected: the
fully_shard docstring: a call manages the module's parameters "except those
already assigned to a group from an earlier call"; the tied parameter is
managed once (or, as from torch 2.13, rejected, naming it).

Run: python fsdp2-split-tie-managed-twice.py
Run: torchrun --nproc-per-node 2 fsdp2-split-tie-managed-twice.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.4, 2.5
    from torch.distributed._composable.fsdp import fully_shard

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


def main():
    init()
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight  # tied
    fully_shard(model[0])
    fully_shard(model[1])
    fully_shard(model)
    try:
        model(torch.randn(2, 4)).sum().backward()
    except ValueError:  # rejected, naming the tie: as specified
        return finish(None, "the tie split over two groups is rejected with a ValueError")
    held = 0  # how many groups manage the tied weight (FSDP2's private state)
    for m in (model[0], model[1]):
        state = fully_shard.state(m)
        for g in getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]:
            held += sum(1 for fp in g.fsdp_params if fp._module_info.param_name == "weight")
    finish(held > 1 and f"the tied weight is managed by {held} fully_shard groups, silently (expected once, or a ValueError)",
           "the tied weight is managed by one group")


if __name__ == "__main__":
    main()
