"""Finding: fsdp2-frozen-int-reshard-group-not-last-backward

Gradient accumulation with set_is_last_backward(False) breaks the next
forward when a group is frozen and resharded to an int after forward:
fully_shard(frozen_module, reshard_after_forward=2) on 4 ranks; microbatch 0
runs forward and backward with set_is_last_backward(False); microbatch 1's
forward raises "RuntimeError: split_with_sizes expects split_sizes to sum
exactly to 1 ... but got split_sizes=[2]". A trainable group, a bool
reshard_after_forward, or is_last_backward left True all work.
Expected: set_is_last_backward(False) only defers the end-of-backward work;
the next microbatch's forward all-gathers the group as usual.

Run: torchrun --nproc-per-node 4 fsdp2-frozen-int-reshard-group-not-last-backward.py
Not shown by: torchrun --nproc-per-node 4 fsdp2-frozen-int-reshard-group-not-last-backward.py last: is_last_backward left True on every microbatch
"""

import os
import socket
import sys

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


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(1, 4, bias=False)  # e.g. a frozen embedding or base layer
        self.frozen.weight.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.frozen(x[:, None]).mean(-1) + x * self.scale


def main():
    init()
    last = sys.argv[1:] == ["last"]
    if dist.get_world_size() != 4:
        finish(None, "needs 4 ranks (reshard_after_forward=2 must divide the shard world and differ from it)")
    torch.manual_seed(0)
    model = Model()
    fully_shard(model.frozen, reshard_after_forward=2)
    fully_shard(model)
    x = torch.linspace(-1.0, 1.0, 4)
    bad = None
    for k in range(2):
        if not last:
            model.set_is_last_backward(k == 1)
        try:
            (model(x) ** 2).sum().backward()
        except RuntimeError as e:
            bad = f"microbatch {k} raised RuntimeError: {str(e).splitlines()[0][:160]}"
            break
    finish(bad, "two accumulated microbatches ran" + (" (is_last_backward left True)" if last else " with set_is_last_backward(False) first"))


if __name__ == "__main__":
    main()
