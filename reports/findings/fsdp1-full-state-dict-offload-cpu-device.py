"""Finding fsdp1-full-state-dict-offload-cpu-device (torch 2.13.0).

FSDP1 on a CPU device (device_id=cpu, gloo): a full state dict taken with
FullStateDictConfig(offload_to_cpu=True) -- directly or through
get_model_state_dict(full_state_dict=True, cpu_offload=True), which asks FSDP1
for it -- reads the unsharded parameters after their storage is freed: with
use_orig_params=False "RuntimeError: setStorage: ... out of bounds for storage
of size 0", with use_orig_params=True a segmentation fault while cloning; the
other ranks then wait in the next all-gather (a hang) or see the peer vanish.
Expected (FullStateDictConfig docstring): the full state dict, offloaded to CPU
(already there), rank 0 only with rank0_only=True.

Run: torchrun --nproc-per-node 2 fsdp1-full-state-dict-offload-cpu-device.py [uop]
     (python ... runs one gloo rank; "uop" sets use_orig_params=True: segfault)
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.proj = nn.Linear(3, 3)

    def forward(self, x):
        return self.proj(self.embed(x))


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    model = FSDP(Model(), device_id=torch.device("cpu"), use_orig_params="uop" in sys.argv[1:])
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    print(f"rank {dist.get_rank()}: taking the full state dict (offload_to_cpu=True)", flush=True)
    try:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            sd = model.state_dict()
        print(f"rank {dist.get_rank()}: got {sorted(sd)} (expected: all keys on rank 0, none elsewhere)")
    except Exception as e:
        print(f"rank {dist.get_rank()}: {type(e).__name__}: {str(e).splitlines()[0]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
