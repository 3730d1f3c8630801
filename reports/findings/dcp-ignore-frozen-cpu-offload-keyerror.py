"""Finding dcp-ignore-frozen-cpu-offload-keyerror (torch 2.13.0).

get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
cpu_offload=True, ignore_frozen_params=True)) on an FSDP1 model with a frozen
parameter: ranks other than 0 get an empty state dict (the docstring: "only
the rank0 will get the state_dict and all other ranks will get empty
state_dict"), then _get_model_state_dict pops every frozen FQN from it:
KeyError on every rank but 0. Expected: an empty dict on those ranks.

Run: torchrun --nproc-per-node 2 dcp-ignore-frozen-cpu-offload-keyerror.py
     (python ... runs one gloo rank, which is rank 0: no error there)
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.requires_grad_(False)  # one uniform (frozen) unit
    # a GPU is where cpu_offload is meant to be used; on CPU FSDP1's offload
    # path has its own failure on rank 0 (fsdp1-full-state-dict-offload-cpu-device)
    device = torch.device("cuda", dist.get_rank()) if torch.cuda.device_count() >= dist.get_world_size() else torch.device("cpu")
    fsdp = FSDP(model, device_id=device, use_orig_params=False)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    try:
        sd = get_model_state_dict(fsdp, options=opts)
        print(f"rank {dist.get_rank()}: {sorted(sd)}", flush=True)
    except Exception as e:
        want = "(expected: {} on this rank)" if dist.get_rank() else "(rank 0: see fsdp1-full-state-dict-offload-cpu-device on CPU)"
        print(f"rank {dist.get_rank()}: {type(e).__name__}: {str(e)[:200]} {want}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
