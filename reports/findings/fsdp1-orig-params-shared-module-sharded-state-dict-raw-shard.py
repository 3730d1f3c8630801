"""Finding: fsdp1-orig-params-shared-module-sharded-state-dict-raw-shard

FSDP1, use_orig_params=True, FULL_SHARD on 2 or more ranks: a module
registered under two names (here `proj` at the root and `block.shared`) that
is not itself an FSDP unit has its parameter flattened into the unit that
reaches it (`block`). The sharded state dict (SHARDED_STATE_DICT, which
get_state_dict / get_model_state_dict use for FSDP1) makes a ShardedTensor
only of the names that unit knows (`block.shared.weight`); under the name
outside the unit (`proj.weight`, whichever of the two comes first) it holds
this rank's raw local shard: a plain 1-D tensor of the shard's numel (25 and
24 of the 7x7 weight's 49 on 2 ranks). A checkpoint saved with
torch.distributed.checkpoint under FSDP2 then does not load into the FSDP1
model: dcp.load raises CheckpointException "Size mismatch between saved
torch.Size([7, 7]) and current: torch.Size([25]) for model.proj.weight".
Expected (get_state_dict docstring: state dicts that "can be resharded with a
different number of trainers and/or different parallelisms"): every name of
the parameter as a sharded tensor of its full shape, and the FSDP2 checkpoint
loads. With use_orig_params=False the other name is dropped instead
(fsdp1-shared-module-state-dict-drops-aliases).

Run: torchrun --nproc-per-node 2 fsdp1-orig-params-shared-module-sharded-state-dict-raw-shard.py
Not shown by: python fsdp1-orig-params-shared-module-sharded-state-dict-raw-shard.py: one rank falls back to NO_SHARD, which keeps the full shape
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
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
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


def net(proj_first):
    model, proj, block = Net(), nn.Linear(7, 7, bias=False), Block()
    for name, m in (("proj", proj), ("block", block)) if proj_first else (("block", block), ("proj", proj)):
        model.add_module(name, m)
    block.shared = proj
    return model


def fsdp1(proj_first):
    return FSDP(net(proj_first), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))


def main():
    init()
    warnings.simplefilter("ignore")
    wrong = []
    for proj_first in (True, False):
        sd = get_model_state_dict(fsdp1(proj_first))
        wrong += [f"{k} is {type(v).__name__} {list(v.shape)} (proj registered {'first' if proj_first else 'second'})"
                  for k, v in sorted(sd.items()) if list(v.shape) != [7, 7]]
    path = [scratch() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    model = net(True)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 7)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path[0])
    model = fsdp1(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    try:
        dcp.load(state, checkpoint_id=path[0])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except BaseException as e:  # CheckpointException derives from BaseException
        wrong.append(f"the FSDP2 checkpoint's dcp.load raised {type(e).__name__} ...{' '.join(str(e).split())[-90:]}")
    finish(wrong and f"rank {dist.get_rank()}'s sharded state dict: {'; '.join(wrong)} (expected the full shape [7, 7] under both names, and the load)",
           "both names have the full shape [7, 7] and the FSDP2 checkpoint loads into FSDP1")


if __name__ == "__main__":
    main()
