"""Finding fsdp1-orig-params-shared-module-sharded-state-dict-raw-shard (torch 2.13.0).

FSDP1, use_orig_params=True, FULL_SHARD on 2 or more ranks: a module
registered under two names (here `proj` at the root and `block.shared`) that
is not itself an FSDP unit has its parameter flattened into the unit that
reaches it (`block`). The sharded state dict (SHARDED_STATE_DICT, which
get_state_dict / get_model_state_dict use for FSDP1) makes a ShardedTensor
only of the names that unit knows (`block.shared.weight`); under the name
outside the unit (`proj.weight`, whichever of the two comes first) it holds
this rank's raw local shard: a plain 1-D tensor of the shard's numel (25 and
24 of the 7x7 weight's 49 on 2 ranks), different on every rank. A checkpoint
saved with torch.distributed.checkpoint under FSDP2 (or any other
parallelism) then does not load into the FSDP1 model: dcp.load raises
CheckpointException "Size mismatch between saved torch.Size([7, 7]) and
current: torch.Size([25]) for model.proj.weight".

Expected (get_state_dict docstring: state dicts that "can be resharded with a
different number of trainers and/or different parallelisms", FSDP1 and
FSDP2): every name of the parameter as a sharded tensor of its full shape,
and the FSDP2 checkpoint loads. With use_orig_params=False the other name is
dropped instead (fsdp1-shared-module-state-dict-drops-aliases). On one rank
FSDP1 switches to NO_SHARD and keeps the full shape: run it with 2 ranks.

Run: torchrun --nproc-per-node 2 fsdp1-orig-params-shared-module-sharded-state-dict-raw-shard.py
     (python ...: one gloo rank, where nothing deviates)
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
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):  # the wrap unit; it reaches the root's proj under another name
    def forward(self, x):
        return self.shared(x)


class Net(nn.Module):
    def forward(self, x):
        return self.block(self.proj(x))


def net(proj_first: bool):
    torch.manual_seed(0)
    model, proj, block = Net(), nn.Linear(7, 7, bias=False), Block()
    for name, m in (("proj", proj), ("block", block)) if proj_first else (("block", block), ("proj", proj)):
        model.add_module(name, m)
    block.shared = proj
    return model


def fsdp1(proj_first: bool):
    return FSDP(net(proj_first), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))


def main():
    if "RANK" not in os.environ:  # plain `python`: a one-process gloo group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    for proj_first in (True, False):
        sd = get_model_state_dict(fsdp1(proj_first))
        print(f"rank {rank} (proj registered {'first' if proj_first else 'second'}): "
              + ", ".join(f"{k}: {type(v).__name__} {list(v.shape)}" for k, v in sorted(sd.items())), flush=True)
    dist.barrier()
    if rank == 0:
        print("expected: under both names the full shape [7, 7] (a ShardedTensor on 2+ ranks)")
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    try:
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
            print(f"rank {rank}: FSDP2 checkpoint loaded into FSDP1 (use_orig_params=True)", flush=True)
        except BaseException as e:  # CheckpointException derives from BaseException
            print(f"rank {rank}: FSDP2 -> FSDP1 dcp.load raised {type(e).__name__}: ...{' '.join(str(e).split())[-110:]}", flush=True)
        dist.barrier()
        if rank == 0:
            print("expected: loaded")
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path[0], ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
