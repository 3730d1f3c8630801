# fsdp2-list-group-partial-call-stays-unsharded: a fully_shard([norm, head])
# group (reshard_after_forward=True, the non-root default) whose module is
# called on its own, outside the root's forward, and so runs only in part
# (the fully_shard docstring's chunked-loss case: the main forward runs norm,
# then head is invoked per chunk), keeps its parameters unsharded after the
# call: reshard_after_forward=True promises they are resharded after forward.
# The next call of the group all-gathers nothing; the full parameters stay in
# memory until backward or until the group's other module runs.
# Mechanism: the standalone call makes the group's own state the iteration's
# forward root; its post-forward leaves the group pending (norm has not run),
# and FSDPState._force_complete_incomplete_states, which completes pending
# groups when the forward root ends, skips the root's own state.
# Control: a call that runs the whole group (or the root forward) reshards it.
# checked: torch 2.13.0+cpu, 2.14.1+cu130 (python repro.py; torchrun --nproc-per-node 2 repro.py)
# run: python repro.py   or   torchrun --nproc-per-node 2 repro.py

import os, socket
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):  # the chunked-loss layout: the head runs per chunk, outside
        return self.norm(self.body(x))


def state(m):
    return "sharded" if isinstance(m.head.weight, DTensor) else "UNSHARDED"


def main():
    if "RANK" not in os.environ:  # plain python: a one-rank gloo group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Model()
    fully_shard(model.body)
    fully_shard([model.norm, model.head])  # reshard_after_forward=None: True for a non-root group
    fully_shard(model)
    x = torch.randn(4, 8)
    h = model(x)
    print(f"rank {rank}: after the root forward (norm ran, head not): head is {state(model)}")
    for i, chunk in enumerate(h.chunk(2)):
        model.head(chunk)
        print(f"rank {rank}: after head(chunk {i}) on its own: head is {state(model)}")
    print(f"rank {rank}: expected: sharded after every call (reshard_after_forward=True)")
    model.norm(torch.randn(4, 8))
    print(f"rank {rank}: control, after norm(...) on its own, which completes the group: head is {state(model)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
