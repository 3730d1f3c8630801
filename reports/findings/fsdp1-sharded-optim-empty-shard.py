"""Finding: fsdp1-sharded-optim-empty-shard

FSDP1's sharded state dict (what get_state_dict gives
torch.distributed.checkpoint) chunks each original parameter along dim 0 as
torch.chunk does. When a parameter's first dimension cannot be spread over the
ranks (1 on 2 ranks; 2 or 4 on 3), some rank's chunk is empty. Saving model and
optimizer with torch.distributed.checkpoint (get_state_dict, dcp.save) and
loading them back into the same model on the same ranks (get_state_dict,
dcp.load, set_state_dict) then fails with "Missing key in checkpoint
state_dict: optim.param_groups" (CheckpointException, on every rank).
Expected (the torch.distributed.checkpoint recipe): the state loads; uneven
and empty shards are ordinary. Uneven non-empty chunks (a dim 0 of 3 on 2
ranks) load; so does FSDP2 with the same shapes.

Run: torchrun --nproc-per-node 2 fsdp1-sharded-optim-empty-shard.py
Not shown by: python fsdp1-sharded-optim-empty-shard.py: one rank has no empty chunk
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


def init():
    """torchrun sets RANK; a plain `python` run is one gloo rank on a free port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")


SCRATCH = []  # rank 0's checkpoint directories: finish() removes them


def scratch():
    SCRATCH.append(tempfile.mkdtemp())
    return SCRATCH[-1]


def finish(deviation, as_specified):
    """Rank 0 prints the verdict last: DEVIATION if a rank saw one (None: it saw none)."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, deviation)
    dist.barrier()
    if dist.get_rank() == 0:
        for d in SCRATCH:  # every rank is past the barrier: done with them
            shutil.rmtree(d, ignore_errors=True)
        found = next((d for d in seen if d), None)
        print(f"DEVIATION: {found}" if found else f"AS SPECIFIED: {as_specified}", flush=True)
    print(end="", flush=True)
    os._exit(0)  # every rank leaves here, the group not torn down (gloo's teardown can abort a rank now and then)


def make():
    model = FSDP(nn.Linear(1, 1, bias=False), device_id=torch.device("cpu"))  # one element: rank 1's shard is empty
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def main():
    init()
    path = [scratch() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
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
        bad = None
    except BaseException as e:  # CheckpointException is a BaseException
        bad = f"loading the checkpoint of a 1x1 weight (an empty shard) raised {type(e).__name__} ...{' '.join(str(e).split())[-90:]}, expected it to load"
    finish(bad, "the checkpoint with an empty shard loaded")


if __name__ == "__main__":
    main()
