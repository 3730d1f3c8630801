"""Finding dcp-optim-state-unfrozen-at-load-missing-key (torch 2.13.0, 2.14.1).

Progressive unfreezing across a restart: a parameter stays frozen while the
job trains (the optimizer, built over all parameters, has no state for it),
the model and optimizer are saved with torch.distributed.checkpoint, and the
job resumes with that parameter trainable. The documented resume recipe
(get_state_dict, dcp.load, set_state_dict) fails in dcp.load with
CheckpointException "Missing key in checkpoint state_dict:
optim.state.<fqn>.momentum_buffer" (Adam: ".step"): get_state_dict on the
fresh optimizer initializes state (_init_optim_state: a zero-gradient step)
for every parameter that requires grad, so the state dict to load asks for
state the checkpoint never had. Expected (get_state_dict docstring: a model
and optimizer state dict "that can be resharded with a different number of
trainers and/or different parallelisms"): the load gives every parameter its
saved state, and the newly trainable one none, as a fresh optimizer has.
FSDP2 and FSDP1, any world size; an all-frozen model unfrozen at load too.

Run: python dcp-optim-state-unfrozen-at-load-missing-key.py   (one gloo rank), or
     torchrun --nproc-per-node 2 dcp-optim-state-unfrozen-at-load-missing-key.py
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
from torch.distributed.fsdp import fully_shard


def make(weight_frozen: bool):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    model.weight.requires_grad_(not weight_frozen)
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # every parameter, frozen or not


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
        model, opt = make(weight_frozen=True)  # trains the bias only
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path[0])
        model, opt = make(weight_frozen=False)  # the resumed job unfreezes the weight
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        try:
            dcp.load(state, checkpoint_id=path[0])
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            print(f"rank {dist.get_rank()}: loaded; optimizer state for", sorted(n for n, p in model.named_parameters() if opt.state.get(p)))
        except BaseException as e:  # CheckpointException derives from BaseException
            print(f"rank {dist.get_rank()}: dcp.load raised {type(e).__name__}: ...{' '.join(str(e).split())[-120:]}")
        if dist.get_rank() == 0:
            print("expected: loaded, with the bias's saved momentum (the weight: none yet)")
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
