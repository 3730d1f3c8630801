"""Finding fsdp1-rank0-only-paramless-root-keeps-buffers (torch 2.4.1 to 2.14.1).

FSDP1, FULL_STATE_DICT with FullStateDictConfig(rank0_only=True): the
docstring promises the full state dict on rank 0 and an empty dict on every
other rank. When the root FSDP unit holds no parameter (every parameter sits in
a child unit: here ModuleWrapPolicy({Linear}) over a model whose root has only
a buffer), ranks other than 0 get the root's buffers, {'running': ...}. With
one parameter in the root unit (shown second) they get {} as promised.
(offload_to_cpu=False: with offload_to_cpu=True on CPU, rank 0 runs into
fsdp1-full-state-dict-offload-cpu-device first.)

Run: torchrun --nproc-per-node 2 fsdp1-rank0-only-paramless-root-keeps-buffers.py
     (python ...: one rank, where there is no other rank to look at)
"""

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Model(nn.Module):
    def __init__(self, root_param: bool):
        super().__init__()
        self.register_buffer("running", torch.zeros(4))
        self.proj = nn.Linear(4, 4)
        if root_param:
            self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.proj(x) + self.running


def main():
    if "RANK" not in os.environ:  # plain `python`: a one-process gloo group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    for root_param in (False, True):
        model = FSDP(Model(root_param), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
            sd = model.state_dict()
        print(f"rank {rank} (root unit {'with' if root_param else 'without'} a parameter): keys {sorted(sd)}", flush=True)
    dist.barrier()
    if rank == 0:
        print("expected: every rank but 0 gets an empty dict")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # every rank leaves here: no gloo teardown


if __name__ == "__main__":
    main()
