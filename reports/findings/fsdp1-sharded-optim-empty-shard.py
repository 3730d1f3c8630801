"""Finding fsdp1-sharded-optim-empty-shard (torch 2.13.0, 2.14.1).

FSDP1's sharded state dict (what get_state_dict gives torch.distributed.checkpoint)
chunks each original parameter along dim 0 as torch.chunk does. When a
parameter's first dimension cannot be spread over the ranks (1 on 2 ranks; 2 or
4 on 3), some rank's chunk is empty. Saving model and optimizer with
torch.distributed.checkpoint (get_state_dict, dcp.save) and loading them back
into the same model on the same ranks (get_state_dict, dcp.load,
set_state_dict) then fails with "Missing key in checkpoint state_dict:
optim.param_groups" (CheckpointException, on every rank). Expected (the
torch.distributed.checkpoint recipe): the state loads; uneven and empty shards
are ordinary (world size not dividing a dimension). Uneven non-empty chunks
(a dim 0 of 3 on 2 ranks) load; so does FSDP2 with the same shapes.

Run: torchrun --nproc-per-node 2 fsdp1-sharded-optim-empty-shard.py
     (python ... runs one gloo rank: no empty chunk, it loads)
"""

import os
import shutil
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def make():
    torch.manual_seed(0)
    model = FSDP(nn.Linear(1, 1, bias=False), device_id=torch.device("cpu"))  # one element: rank 1's shard is empty
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    try:
        model, opt = make()
        model(torch.ones(2, 1)).sum().backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path[0])
        model, opt = make()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        try:
            dcp.load(state, checkpoint_id=path[0])
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            print(f"rank {dist.get_rank()}: loaded")
        except BaseException as e:  # CheckpointException is a BaseException
            print(f"rank {dist.get_rank()}: {type(e).__name__}: {' '.join(str(e).split())[-160:]}")
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
