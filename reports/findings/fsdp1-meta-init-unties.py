"""Finding fsdp1-meta-init-unties (torch 2.13.0).

FSDP1 meta-device initialization (FullyShardedDataParallel's param_init_fn,
as its docstring prescribes: it "should only initialize the parameters/buffers
of the module, not those of its submodules", e.g. module.to_empty(device,
recurse=False)) materializes each module on its own: a Parameter tied between
two modules becomes two Parameters, so the wrapped model (use_orig_params=True)
has one more parameter and its tied names no longer share one (FSDP2's
fully_shard + to_empty keeps the tie). Expected: the tie kept.

Run: python fsdp1-meta-init-unties.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp1-meta-init-unties.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, x):
        return self.head(self.embed(x))


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    with torch.device("meta"):
        model = LM()
    fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True,
                param_init_fn=lambda m: m.to_empty(device=torch.device("cpu"), recurse=False))
    tied = fsdp.head.weight is fsdp.embed.weight
    n = len(list(fsdp.parameters()))
    if dist.get_rank() == 0:
        print(f"after meta-device init: tied {tied}, {n} parameters (expected: tied True, 1 parameter)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
