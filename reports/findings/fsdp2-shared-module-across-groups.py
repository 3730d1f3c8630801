"""Finding: fsdp2-shared-module-across-groups

A module registered under two parents (one nn.Linear as block.lin and as
shared) whose parameters end up visible to two fully_shard groups: the first
group shards them (the module's parameters become DTensors), the second
group's fully_shard meets those DTensors, takes them for tensor-parallel
parameters and fails inside DeviceMesh._concatenate with "TypeError: Invariant
encountered: value was None when it should not be". Expected: torch 2.13's own
check for a parameter two groups see (ValueError naming the parameter and
prescribing fully_shard([a, b]) or sharding the shared module first), or the
fully_shard docstring's promise that parameters already assigned by an earlier
call are left out; not an internal TypeError. Another form: a list group
applied after one of its modules' parents took it in
(fsdp2-resharded-module-tie.py).

Run: python fsdp2-shared-module-across-groups.py
Run: torchrun --nproc-per-node 2 fsdp2-shared-module-across-groups.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


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


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4))
        self.shared = self.block[0]  # the same Linear under a second name

    def forward(self, x):
        return self.shared(self.block(x))


def main():
    init()
    model = Model()
    fully_shard(model.block)
    try:
        fully_shard(model)
        model(torch.randn(2, 4))
        bad = None
    except ValueError:  # a clear rejection naming the shared parameter is as specified
        bad = None
    except Exception as e:
        bad = f"a module shared by two fully_shard groups fails with {type(e).__name__}: {str(e).splitlines()[0]} (expected it managed once, or a ValueError naming it)"
    finish(bad, "the shared module is managed once, or rejected with a ValueError")


if __name__ == "__main__":
    main()
