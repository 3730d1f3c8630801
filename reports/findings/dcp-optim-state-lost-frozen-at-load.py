"""Finding dcp-optim-state-lost-frozen-at-load (torch 2.13.0).

Progressive freezing across a restart: a parameter trains (the optimizer, built
over all parameters, keeps momentum / Adam moments for it), the model and
optimizer are saved with torch.distributed.checkpoint, and the job resumes
with that parameter frozen. After get_state_dict, dcp.load and set_state_dict
the parameter has no optimizer state: _init_optim_state makes state only for
parameters that require grad, and set_optimizer_state_dict loads state only
for those. Expected: every parameter that had optimizer state has exactly that
state after the load, whatever its requires_grad (it trains again later with
its momentum). Same under FSDP1 and FSDP2, any world size.

Run: python dcp-optim-state-lost-frozen-at-load.py   (one gloo rank), or
     torchrun --nproc-per-node 2 dcp-optim-state-lost-frozen-at-load.py
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


def make(frozen_first: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].requires_grad_(not frozen_first)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)  # every parameter, frozen or not


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
        model, opt = make(frozen_first=False)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path[0])
        full = StateDictOptions(full_state_dict=True)
        before = sorted(get_optimizer_state_dict(model, opt, options=full)["state"])
        model, opt = make(frozen_first=True)  # the resumed job freezes model[0]
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path[0])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        after = sorted(get_optimizer_state_dict(model, opt, options=full)["state"])
        has = {n: bool(opt.state.get(p)) for n, p in model.named_parameters()}
        if dist.get_rank() == 0:
            print(f"optimizer state saved for {before}")
            print(f"after the load: {after}; per parameter: {has}")
            print("expected: the same parameters as saved, 0.weight and 0.bias included")
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
