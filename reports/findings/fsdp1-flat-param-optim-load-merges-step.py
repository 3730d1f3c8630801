"""Finding: fsdp1-flat-param-optim-load-merges-step

A checkpoint whose parameters trained different numbers of Adam steps (`a`
frozen after the first step, `b` trained two; saved from FSDP2, where each
parameter has its own state) is loaded with torch.distributed.checkpoint into
FSDP1 with flat parameters (use_orig_params=False), `a` and `b` in one unit.
The load silently gives `a` the step count of `b` (1 -> 2), so Adam's bias
correction for `a`'s moments is no longer the one its training had.

Why: get_state_dict on the FSDP1 model hands out the optimizer state with one
`step` tensor object shared by every parameter of the flat parameter;
dcp.load copies the checkpoint into that dict in place, so the last
parameter's step overwrites the others'. FSDP1's own flattening refuses
differing scalar state ("ValueError: All unflattened parameters comprising a
single flat parameter must have scalar state with the same value"), but it
only ever sees the merged value. Expected: the loaded state is the saved one,
or that ValueError. With use_orig_params=True the steps load as saved.

On 3 ranks dcp.load raises first ("Missing key in checkpoint state_dict:
optim.param_groups"): rank 2's shard of the flat parameter holds nothing of
`a`, which is fsdp1-sharded-optim-empty-shard, another finding.

Run: python fsdp1-flat-param-optim-load-merges-step.py
Run: torchrun --nproc-per-node 2 fsdp1-flat-param-optim-load-merges-step.py
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

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
    init()
    warnings.simplefilter("ignore")
    path = [scratch() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    model = Net()
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for i in range(2):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        model.a.weight.requires_grad_(False)  # a trains one step, b two
    saved = steps(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path[0])
    wrong = []
    for uop in (False, True):
        model = FSDP(Net(), use_orig_params=uop, device_id=torch.device("cpu"))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path[0])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = steps(model, opt)
        if loaded != saved:
            wrong.append(f"use_orig_params={uop} loaded Adam steps {loaded}")
    finish(wrong and f"saved Adam steps {saved}, but FSDP1 {', '.join(wrong)} (expected the saved steps or a ValueError)",
           f"FSDP1 loaded the saved Adam steps {saved}")


if __name__ == "__main__":
    main()
