"""Finding: fsdp2-rejects-container-subclass-with-forward

fully_shard rejects any nn.ModuleList / nn.ModuleDict instance with
"ValueError: fully_shard does not support containers that do not implement
forward", also a subclass that does implement forward. The check is an
isinstance test only; later releases also look at whether the class overrides
forward (torch 2.13: `module.__class__.forward is nn.Module.forward`).
Expected: a container subclass with its own forward is an ordinary module to
fully_shard (the message itself names containers that do NOT implement
forward); it is sharded like any other.

Run: python fsdp2-rejects-container-subclass-with-forward.py
Run: torchrun --nproc-per-node 2 fsdp2-rejects-container-subclass-with-forward.py
"""

import os
import socket

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


class Blocks(nn.ModuleDict):
    def forward(self, x):
        for block in self.values():
            x = block(x)
        return x


def main():
    init()
    try:
        fully_shard(Blocks({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)}))
        bad = None
    except ValueError as e:
        bad = f"fully_shard rejected a ModuleDict subclass with its own forward: ValueError {str(e).splitlines()[0]} (expected it sharded)"
    finish(bad, "fully_shard shards a ModuleDict subclass with its own forward")


if __name__ == "__main__":
    main()
