"""Finding: dcp-optim-state-lost-frozen-at-load

Progressive freezing across a restart: a parameter trains (the optimizer, built
over all parameters, keeps Adam moments for it), the model and optimizer are
saved with torch.distributed.checkpoint, and the job resumes with that
parameter frozen. After get_state_dict, dcp.load and set_state_dict the
parameter has no optimizer state: _init_optim_state makes state only for
parameters that require grad, and set_optimizer_state_dict loads state only
for those. Expected: every parameter that had optimizer state has it after the
load, whatever its requires_grad (it trains again later with its moments).
Same under FSDP1 and FSDP2, any world size.

Run: python dcp-optim-state-lost-frozen-at-load.py
Run: torchrun --nproc-per-node 2 dcp-optim-state-lost-frozen-at-load.py
"""

import os
import shutil
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard


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


def make(frozen_first):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].requires_grad_(not frozen_first)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)  # every parameter, frozen or not


def main():
    init()
    path = [scratch() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    model, opt = make(frozen_first=False)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path[0])
    full = StateDictOptions(full_state_dict=True)
    saved = sorted(get_optimizer_state_dict(model, opt, options=full)["state"])
    model, opt = make(frozen_first=True)  # the resumed job freezes model[0]
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path[0])
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = sorted(get_optimizer_state_dict(model, opt, options=full)["state"])
    lost = sorted(set(saved) - set(loaded))
    finish(lost and f"after dcp.load and set_state_dict the frozen {lost} have no optimizer state, expected the saved state of {saved}",
           f"every parameter has its saved optimizer state ({saved})")


if __name__ == "__main__":
    main()
