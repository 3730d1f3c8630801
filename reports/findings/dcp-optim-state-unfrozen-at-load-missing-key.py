"""Finding: dcp-optim-state-unfrozen-at-load-missing-key

Progressive unfreezing across a restart: a parameter stays frozen while the
job trains (the optimizer, built over all parameters, has no state for it),
the model and optimizer are saved with torch.distributed.checkpoint, and the
job resumes with that parameter trainable. The documented resume recipe
(get_state_dict, dcp.load, set_state_dict) fails in dcp.load with
CheckpointException "Missing key in checkpoint state_dict:
optim.state.<fqn>.momentum_buffer": get_state_dict on the fresh optimizer
initializes state (_init_optim_state: a zero-gradient step) for every
parameter that requires grad, so the state dict to load asks for state the
checkpoint never had. Expected (get_state_dict docstring: a state dict "that
can be resharded with a different number of trainers and/or different
parallelisms"): the load gives every parameter its saved state, and the newly
trainable one none. FSDP2 and FSDP1, any world size.

Run: python dcp-optim-state-unfrozen-at-load-missing-key.py
Run: torchrun --nproc-per-node 2 dcp-optim-state-unfrozen-at-load-missing-key.py
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


def make(weight_frozen):
    model = nn.Linear(4, 4)
    model.weight.requires_grad_(not weight_frozen)
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # every parameter, frozen or not


def main():
    init()
    path = [scratch() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
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
        got = sorted(n for n, p in model.named_parameters() if opt.state.get(p))
        bad = got != ["bias"] and f"the load left optimizer state for {got}, expected the bias's saved momentum only"
    except BaseException as e:  # CheckpointException derives from BaseException
        bad = f"dcp.load raised {type(e).__name__} ...{' '.join(str(e).split())[-90:]}, expected the bias's saved momentum loaded"
    finish(bad, "the load gave the bias its saved momentum and the unfrozen weight none")


if __name__ == "__main__":
    main()
