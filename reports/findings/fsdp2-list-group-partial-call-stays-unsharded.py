"""Finding: fsdp2-list-group-partial-call-stays-unsharded

A fully_shard([norm, head]) group (reshard_after_forward=True, the non-root
default) whose module is called on its own, outside the root's forward, and so
runs only in part (the fully_shard docstring's chunked-loss case: the main
forward runs norm, then head is invoked per chunk), keeps its parameters
unsharded after the call: reshard_after_forward=True promises they are
resharded after forward. The full parameters stay in memory until backward or
until the group's other module runs. Mechanism: the standalone call makes the
group's own state the iteration's forward root; its post-forward leaves the
group pending (norm has not run), and
FSDPState._force_complete_incomplete_states, which completes pending groups
when the forward root ends, skips the root's own state. Control: a call that
runs the whole group (or the root forward) reshards it.

Run: python fsdp2-list-group-partial-call-stays-unsharded.py
Run: torchrun --nproc-per-node 2 fsdp2-list-group-partial-call-stays-unsharded.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


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
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):  # the chunked-loss layout: the head runs per chunk, outside
        return self.norm(self.body(x))


def main():
    init()
    model = Model()
    fully_shard(model.body)
    fully_shard([model.norm, model.head])  # reshard_after_forward=None: True for a non-root group
    fully_shard(model)
    unsharded = []
    for i, chunk in enumerate(model(torch.randn(4, 8)).chunk(2)):
        model.head(chunk)
        if not isinstance(model.head.weight, DTensor):
            unsharded.append(i)
    finish(unsharded and f"after head(chunk) on its own (chunks {unsharded}) the [norm, head] group stays unsharded, "
           "expected resharded (reshard_after_forward=True)", "the [norm, head] group is resharded after every head(chunk) call")


if __name__ == "__main__":
    main()
