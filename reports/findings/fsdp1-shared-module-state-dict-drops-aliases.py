"""Finding: fsdp1-shared-module-state-dict-drops-aliases

FSDP1, use_orig_params=False: a module registered under several names (T5's
`shared` embedding is also encoder.embed_tokens and decoder.embed_tokens; here
`proj` at the root is also `block.shared`) that is not itself an FSDP unit has
its parameter flattened into the unit that reaches it first (`block`).
Flattening replaces the module's Parameter with a plain tensor attribute, so
under every other name (`proj.weight`; in T5 also a name in another unit) the
parameter is gone from the full state_dict, and loading it with strict=True
into the unwrapped model fails. The optimizer sees the same flattening: the
optimizer state dict (FSDP.optim_state_dict, get_state_dict) keys the
parameter by its name inside the unit (`block.shared.weight`), not by its first
name (`proj.weight`, as the unwrapped model, use_orig_params=True and FSDP2
do), in `state` and in `param_groups`; a checkpoint saved with
torch.distributed.checkpoint under FSDP2 then does not load into the FSDP1
model ("Missing key in checkpoint state_dict:
optim.state.block.shared.weight.momentum_buffer"). Expected (FULL_STATE_DICT:
the unwrapped model's keys; get_state_dict: state dicts that "can be resharded
with ... different parallelisms"): the unwrapped model's keys, and the
optimizer state under the FQNs the unwrapped model and FSDP2 use. Related:
fsdp1-shared-unit-state-dict-alias (the shared module itself is a unit).

Run: python fsdp1-shared-module-state-dict-drops-aliases.py
Run: torchrun --nproc-per-node 2 fsdp1-shared-module-state-dict-drops-aliases.py
"""

import os
import shutil
import socket
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


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


class Block(nn.Module):  # the wrap unit; it reaches the root's proj under another name
    def forward(self, x):
        return self.shared(x)


class Net(nn.Module):
    def forward(self, x):
        return self.block(self.proj(x))


def net():
    model = Net()
    model.proj = nn.Linear(4, 4, bias=False)  # first name: proj.weight
    model.block = Block()
    model.block.shared = model.proj  # second name: block.shared.weight
    return model


def fsdp1():
    return FSDP(net(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=False, device_id=torch.device("cpu"))


def main():
    init()
    warnings.simplefilter("ignore")
    wrong = []
    model, want = fsdp1(), list(net().state_dict())
    got = [k.replace("_fsdp_wrapped_module.", "") for k in model.state_dict()]
    if got != want:
        wrong.append(f"the full state_dict has keys {got}, the unwrapped model {want}")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _, osd = get_state_dict(model, opt)  # (initializes the state: a zero-gradient step)
    names = sorted(osd["state"]), [g["params"] for g in osd["param_groups"]]
    if names != (["proj.weight"], [["proj.weight"]]):
        wrong.append(f"get_state_dict's optimizer state and param_groups name {names}, the unwrapped model proj.weight")
    path = [scratch() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    model = net()
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path[0])
    model = fsdp1()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    try:
        dcp.load(state, checkpoint_id=path[0])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except BaseException as e:  # CheckpointException derives from BaseException
        wrong.append(f"an FSDP2 checkpoint's dcp.load raised {type(e).__name__} ...{' '.join(str(e).split())[-90:]}")
    finish(wrong and f"FSDP1 (use_orig_params=False) with a module under two names: {'; '.join(wrong)}",
           "the state dict and optimizer state dict use the unwrapped model's names, and the FSDP2 checkpoint loads")


if __name__ == "__main__":
    main()
