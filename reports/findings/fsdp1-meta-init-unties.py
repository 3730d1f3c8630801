"""Finding: fsdp1-meta-init-unties

FSDP1 meta-device initialization (FullyShardedDataParallel's param_init_fn,
as its docstring prescribes: it "should only initialize the parameters/buffers
of the module, not those of its submodules", e.g. module.to_empty(device,
recurse=False)) materializes each module on its own: a Parameter tied between
two modules becomes two Parameters, so the wrapped model (use_orig_params=True)
has one more parameter and its tied names no longer share one (FSDP2's
fully_shard + to_empty keeps the tie). Expected: the tie kept.

Run: python fsdp1-meta-init-unties.py
Run: torchrun --nproc-per-node 2 fsdp1-meta-init-unties.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


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


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # tied


def main():
    init()
    with torch.device("meta"):
        model = LM()
    fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True,
                param_init_fn=lambda m: m.to_empty(device=torch.device("cpu"), recurse=False))
    tied, n = fsdp.head.weight is fsdp.embed.weight, len(list(fsdp.parameters()))
    finish(not tied and f"after meta-device init (param_init_fn=to_empty(recurse=False)) head.weight and embed.weight are {n} Parameters, "
           "expected one tied Parameter", "the tie survived meta-device init: one Parameter")


if __name__ == "__main__":
    main()
