"""Finding: fsdp1-rank0-only-paramless-root-keeps-buffers

FSDP1, FULL_STATE_DICT with FullStateDictConfig(rank0_only=True): the
docstring promises the full state dict on rank 0 and an empty dict on every
other rank. When the root FSDP unit holds no parameter (every parameter sits in
a child unit: here ModuleWrapPolicy({Linear}) over a model whose root has only
a buffer), ranks other than 0 get the root's buffers, {'running': ...}. With
one parameter in the root unit (the control) they get {} as promised.
(offload_to_cpu=False: with offload_to_cpu=True on CPU, rank 0 runs into
fsdp1-full-state-dict-offload-cpu-device first.)

Run: torchrun --nproc-per-node 2 fsdp1-rank0-only-paramless-root-keeps-buffers.py
Not shown by: python fsdp1-rank0-only-paramless-root-keeps-buffers.py: its one rank is rank 0, which gets the full state dict
"""

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


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
    def __init__(self, root_param):
        super().__init__()
        self.register_buffer("running", torch.zeros(4))
        self.proj = nn.Linear(4, 4)
        if root_param:
            self.scale = nn.Parameter(torch.ones(4))


def main():
    init()
    warnings.simplefilter("ignore")
    wrong = []
    for root_param in (False, True):
        model = FSDP(Model(root_param), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
            sd = model.state_dict()
        if dist.get_rank() > 0 and sd:
            wrong.append(f"root unit {'with' if root_param else 'without'} a parameter: keys {sorted(sd)}")
    finish(wrong and f"rank {dist.get_rank()}'s full state dict (rank0_only=True): {'; '.join(wrong)}, expected {{}}",
           "every rank but 0 got an empty state dict")


if __name__ == "__main__":
    main()
