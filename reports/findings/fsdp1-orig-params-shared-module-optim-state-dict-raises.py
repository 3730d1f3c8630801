"""Finding fsdp1-orig-params-shared-module-optim-state-dict-raises (torch 2.13.0).

FSDP1, use_orig_params=True: a module registered under two names (here `proj`
at the root and `block.shared`) that is not itself an FSDP unit has its
parameter flattened into the unit that reaches it (`block`). When that unit
also has parameters of its own (`block.weight`) and the module's first name is
outside the unit (`proj` registered before `block`), the optimizer state dict
cannot be taken: FSDP.optim_state_dict, and with it get_state_dict /
get_optimizer_state_dict, raises

    RuntimeError: block.shared.weight is not in the optimizer state. The
    FSDPParamInfo has the param keys ['block.shared.weight', 'block.weight']
    while the optimizer has the param keys ['block.weight'].

The optimizer knows the parameter by its first name (`proj.weight`), the
unit's FSDPParamInfo only by its name inside the unit: the lookup
(_convert_state_with_orig_params) finds the unit's other parameter and then
misses this one. No checkpoint can be saved, and none loaded either (a load
takes the optimizer state dict first to learn its keys). Registered the other
way round (`block` first), or with no parameter of the unit's own, it works;
use_orig_params=False and FSDP2 work. On one rank as on several.

Expected (FSDP.optim_state_dict docstring; get_state_dict: "Return the model
state_dict and optimizers state_dict"): the optimizer state dict, keyed by
the parameter's names as the model has them.

Run: python fsdp1-orig-params-shared-module-optim-state-dict-raises.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp1-orig-params-shared-module-optim-state-dict-raises.py
"""

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):  # the wrap unit: a parameter of its own, and the root's proj under another name
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return self.shared(x) @ self.weight


class Net(nn.Module):
    def forward(self, x):
        return self.block(x)


def net(proj_first: bool):
    torch.manual_seed(0)
    model, proj, block = Net(), nn.Linear(4, 4, bias=False), Block()
    for name, m in (("proj", proj), ("block", block)) if proj_first else (("block", block), ("proj", proj)):
        model.add_module(name, m)
    block.shared = proj
    return model


def main():
    if "RANK" not in os.environ:  # plain `python`: a one-process gloo group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    for proj_first in (False, True):
        model = FSDP(net(proj_first), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        for what, take in (("FSDP.optim_state_dict", lambda: FSDP.optim_state_dict(model, opt)["state"]),
                           ("get_state_dict", lambda: get_state_dict(model, opt)[1]["state"])):
            try:
                got = f"state for {sorted(take())}"
            except RuntimeError as e:
                got = f"raised RuntimeError: {' '.join(str(e).split())[:150]}"
            if rank == 0:
                print(f"proj registered {'first' if proj_first else 'second'}: {what} {got}", flush=True)
    if rank == 0:
        print("expected: both orders give the optimizer state of every parameter")
    # every rank leaves here: a barrier, then exit without tearing gloo down
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
