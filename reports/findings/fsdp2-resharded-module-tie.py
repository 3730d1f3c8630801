"""Finding: fsdp2-shared-module-across-groups

The second form of fsdp2-shared-module-across-groups (found by seed 11 of
`run --examples 200`): a Parameter tied between a.x and b.x, given to FSDP2 as
the list group fully_shard([a.x, b.x]) after fully_shard(a) already took a.x
in (the only order when the list straddles a). The list group's fully_shard
meets the DTensor the first call made, takes it for a tensor-parallel
parameter and fails inside DeviceMesh._concatenate with "TypeError: Invariant
encountered: value was None when it should not be". Expected: the fully_shard
docstring's promise that parameters already assigned by an earlier call are
left out, or torch 2.13's own ValueError for a parameter two groups see; not
an internal TypeError.

Run: python fsdp2-resharded-module-tie.py
Run: torchrun --nproc-per-node 2 fsdp2-resharded-module-tie.py
"""

import os
import socket

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


def main():
    init()
    model = nn.Module()
    for name in ("a", "b"):
        model.add_module(name, nn.Module())
        getattr(model, name).x = nn.Linear(3, 3, bias=False)
    model.b.x.weight = model.a.x.weight  # tied
    fully_shard(model.a)
    try:
        fully_shard([model.a.x, model.b.x])
        fully_shard(model)
        bad = None
    except ValueError:  # a clear rejection naming the tie is as specified
        bad = None
    except Exception as e:
        bad = f"the list group [a.x, b.x] after fully_shard(a) fails with {type(e).__name__}: {str(e).splitlines()[0]} (expected a.x left out, or a ValueError)"
    finish(bad, "the list group after fully_shard(a) leaves a.x out, or is rejected with a ValueError")


if __name__ == "__main__":
    main()
