"""Finding fsdp2-rejects-container-subclass-with-forward (torch releases: see
conformance/known_failures.toml, measured by the release matrix).

fully_shard rejects any nn.ModuleList / nn.ModuleDict instance with
"ValueError: fully_shard does not support containers that do not implement
forward", also a subclass that does implement forward. The check is an
isinstance test only; later releases also look at whether the class overrides
forward (torch 2.13: `module.__class__.forward is nn.Module.forward`).

Expected: a container subclass with its own forward is an ordinary module to
fully_shard (the message itself names containers that do NOT implement
forward); it is sharded like any other.

Run: python fsdp2-rejects-container-subclass-with-forward.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp2-rejects-container-subclass-with-forward.py
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


class Blocks(nn.ModuleDict):
    def forward(self, x):
        for block in self.values():
            x = block(x)
        return x


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    model = Blocks({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    try:
        fully_shard(model)
        print("no error: the ModuleDict subclass with a forward is sharded")
    except ValueError as e:
        print(f"ValueError: {str(e).splitlines()[0]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
