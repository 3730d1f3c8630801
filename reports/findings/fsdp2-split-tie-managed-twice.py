"""Finding fsdp2-split-tie-managed-twice (torch releases: see
conformance/known_failures.toml, measured by the release matrix).

A Parameter tied between two modules that are sharded by two separate
fully_shard calls (fully_shard(model.a), fully_shard(model.b)) is taken by
both groups: each makes its own sharded copy and its own all-gather and
reduce-scatter for it. No error is raised and the tie is silently managed
twice. torch 2.13 rejects the case at the first forward with a ValueError
that names the parameter and prescribes fully_shard([a, b]).

Expected: the fully_shard docstring: a call manages the module's parameters
"except those already assigned to a group from an earlier call"; the tied
parameter is managed once (or, as from torch 2.13, rejected, naming it).

Run: python fsdp2-split-tie-managed-twice.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp2-split-tie-managed-twice.py
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


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight  # tied

    def forward(self, x):
        return self.b(self.a(x))


def groups_holding(model: nn.Module, module_names) -> int:
    """How many fully_shard groups manage the tied parameter (FSDP2's private state)."""
    n = 0
    for name in module_names:
        state = fully_shard.state(getattr(model, name))
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
        for g in groups:
            n += sum(1 for fp in g.fsdp_params if fp._module_info.param_name == "weight")
    return n


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    model = Model()
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    try:
        model(torch.randn(2, 4)).sum().backward()
        held = groups_holding(model, ["a", "b"])
        tie = model.a.weight is model.b.weight
        print(f"no error: the tied weight is managed by {held} group(s); tie {'kept' if tie else 'broken'}")
    except ValueError as e:
        print(f"ValueError: {str(e).splitlines()[0]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
