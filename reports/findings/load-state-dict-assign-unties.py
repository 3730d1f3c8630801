"""Finding: load-state-dict-assign-unties

nn.Module.load_state_dict(state_dict, assign=True) -- the load FSDP2's
meta-device recipe uses (DTensors laid out as the model's, assign=True), and
the usual load of pretrained weights into a meta-initialized model before
FSDP1 wraps it -- replaces each name's Parameter with its own new Parameter:
names that shared one Parameter (tied weights: an LM head and its embedding)
no longer do, and model.parameters() has one more entry per tie. Expected:
tied names still share one Parameter, the parameter count unchanged.

Run: python load-state-dict-assign-unties.py
Run: torchrun --nproc-per-node 2 load-state-dict-assign-unties.py
"""

import os
import socket

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor


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
    full = {k: v.clone() for k, v in LM().state_dict().items()}
    plain = LM()
    plain.load_state_dict(full, assign=True)
    model = LM()
    fully_shard(model)
    model.load_state_dict({k: distribute_tensor(full[k], v.device_mesh, v.placements) for k, v in model.state_dict().items()}, assign=True)
    untied = [what for what, m in (("a plain module", plain), ("a fully_shard module (DTensor state dict)", model))
              if m.head.weight is not m.embed.weight]
    finish(untied and f"load_state_dict(assign=True) untied head.weight and embed.weight in {' and '.join(untied)} (expected one Parameter)",
           "load_state_dict(assign=True) kept the tie")


if __name__ == "__main__":
    main()
