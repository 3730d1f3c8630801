"""Finding: fsdp1-full-state-dict-offload-cpu-device

FSDP1 on a CPU device (device_id=cpu, gloo): a full state dict taken with
FullStateDictConfig(offload_to_cpu=True) -- directly or through
get_model_state_dict(full_state_dict=True, cpu_offload=True), which asks FSDP1
for it -- reads the unsharded parameters after their storage is freed: with
use_orig_params=False "RuntimeError: setStorage: ... out of bounds for storage
of size 0" on rank 0 (shown here), with use_orig_params=True a segmentation
fault while cloning (not run here). Expected (FullStateDictConfig docstring):
the full state dict, offloaded to CPU (already there), on rank 0 only with
rank0_only=True.

Run: torchrun --nproc-per-node 2 fsdp1-full-state-dict-offload-cpu-device.py
Not shown by: python fsdp1-full-state-dict-offload-cpu-device.py: one rank falls back to NO_SHARD, whose parameters are never freed
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
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


def main():
    init()
    model = FSDP(nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 3)), device_id=torch.device("cpu"))
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    want = ["0.weight", "1.bias", "1.weight"] if dist.get_rank() == 0 else []
    try:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            got = sorted(model.state_dict())
    except Exception as e:
        got = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    finish(got != want and f"rank {dist.get_rank()}'s full state dict (offload_to_cpu=True, CPU device) gave {got}, expected {want}",
           "the full state dict offloaded to CPU: every key on rank 0, none elsewhere")


if __name__ == "__main__":
    main()
