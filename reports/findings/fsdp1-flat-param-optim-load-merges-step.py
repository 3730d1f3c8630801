"""Finding fsdp1-flat-param-optim-load-merges-step (torch 2.13.0, 2.14.1).

A checkpoint whose parameters trained different numbers of Adam steps (`a`
frozen after the first step, `b` trained two: progressive freezing, or a
checkpoint from FSDP2 / FSDP1 use_orig_params=True, where each parameter has
its own state) is loaded with torch.distributed.checkpoint into FSDP1 with
flat parameters (use_orig_params=False), `a` and `b` in one unit. The load
silently gives `a` the step count of `b` (1 -> 2), so Adam's bias correction
for `a`'s moments is no longer the one its training had.

Why: get_state_dict on the FSDP1 model hands out the optimizer state with
one `step` tensor object shared by every parameter of the flat parameter;
dcp.load copies the checkpoint into that dict in place, so the last
parameter's step overwrites the others'. FSDP1's own flattening
(_flatten_zero_dim_tensor_optim_state) refuses differing scalar state with
"ValueError: All unflattened parameters comprising a single flat parameter
must have scalar state with the same value" -- "needed to maintain the
invariant that FSDP performs the same computation as its non-sharded
equivalent" -- but it only ever sees the merged value.

Expected: the loaded state is the saved one, or that ValueError. With
use_orig_params=True the steps load as saved.

Run: python fsdp1-flat-param-optim-load-merges-step.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp1-flat-param-optim-load-merges-step.py
"""

import os
import shutil
import socket
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.b(self.a(x))


def steps(model, opt):
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {k: int(v["step"]) for k, v in sorted(osd["state"].items())}


def main():
    if "RANK" not in os.environ:  # plain `python`: a one-process gloo group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    torch.manual_seed(0)
    model = Net()
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for i in range(2):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if i == 0:
            model.a.weight.requires_grad_(False)  # a trains one step, b two
    saved = steps(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path[0])
    for uop in (False, True):
        torch.manual_seed(0)
        model = FSDP(Net(), use_orig_params=uop, device_id=torch.device("cpu"))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        msd, osd = get_state_dict(model, opt)
        shared = osd["state"]["a.weight"]["step"] is osd["state"]["b.weight"]["step"]
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path[0])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = steps(model, opt)  # a collective: every rank
        if rank == 0:
            print(f"saved Adam steps {saved}; loaded into FSDP1 use_orig_params={uop}: {loaded} "
                  f"(one step tensor for both in get_state_dict: {shared})", flush=True)
    if rank == 0:
        print(f"expected: {saved} both times (or FSDP1's ValueError for differing scalar state)")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path[0], ignore_errors=True)
    sys.stdout.flush()
    os._exit(0)  # every rank leaves here: no gloo teardown


if __name__ == "__main__":
    main()
