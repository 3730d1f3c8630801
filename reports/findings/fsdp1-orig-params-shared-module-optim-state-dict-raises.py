"""Finding: fsdp1-orig-params-shared-module-optim-state-dict-raises

FSDP1, use_orig_params=True: a module registered under two names (here `proj`
at the root and `block.shared`) that is not itself an FSDP unit has its
parameter flattened into the unit that reaches it (`block`). When that unit
also has parameters of its own (`block.weight`) and the module's first name is
outside the unit (`proj` registered before `block`), the optimizer state dict
cannot be taken: FSDP.optim_state_dict, and with it get_state_dict /
get_optimizer_state_dict, raises "RuntimeError: block.shared.weight is not in
the optimizer state. The FSDPParamInfo has the param keys
['block.shared.weight', 'block.weight'] while the optimizer has the param keys
['block.weight']". The optimizer knows the parameter by its first name
(`proj.weight`), the unit's FSDPParamInfo only by its name inside the unit
(_convert_state_with_orig_params). No checkpoint can be saved or loaded.
Registered the other way round (`block` first, the control), it works;
use_orig_params=False and FSDP2 work. Expected (FSDP.optim_state_dict and
get_state_dict docstrings): the optimizer state dict, keyed by the parameter's
names as the model has them.

Run: python fsdp1-orig-params-shared-module-optim-state-dict-raises.py
Run: torchrun --nproc-per-node 2 fsdp1-orig-params-shared-module-optim-state-dict-raises.py
"""

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def init():
    """torchrun sets RANK; a plain `python` run is one gloo rank on a free port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")


def finish(deviation, as_specified):
    """Rank 0 prints the verdict last: DEVIATION if a rank saw one (None: it saw none)."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, deviation)
    dist.barrier()
    if dist.get_rank() == 0:
        found = next((d for d in seen if d), None)
        print(f"DEVIATION: {found}" if found else f"AS SPECIFIED: {as_specified}", flush=True)
    print(end="", flush=True)
    os._exit(0)  # every rank leaves here, the group not torn down (gloo's teardown can abort a rank now and then)


class Block(nn.Module):  # the wrap unit: a parameter of its own, and the root's proj under another name
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return self.shared(x) @ self.weight


class Net(nn.Module):
    def forward(self, x):
        return self.block(x)


def net(proj_first):
    model, proj, block = Net(), nn.Linear(4, 4, bias=False), Block()
    for name, m in (("proj", proj), ("block", block)) if proj_first else (("block", block), ("proj", proj)):
        model.add_module(name, m)
    block.shared = proj
    return model


def main():
    init()
    warnings.simplefilter("ignore")
    failed = []
    for proj_first in (False, True):
        model = FSDP(net(proj_first), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        for what, take in (("FSDP.optim_state_dict", lambda: FSDP.optim_state_dict(model, opt)),
                           ("get_state_dict", lambda: get_state_dict(model, opt)[1])):
            try:
                take()
            except RuntimeError as e:
                failed.append(f"proj registered {'first' if proj_first else 'second'}: {what} raised RuntimeError {' '.join(str(e).split())[:110]}")
    finish(failed and f"{'; '.join(failed)} (expected the optimizer state of every parameter)",
           "both registration orders give the optimizer state dict")


if __name__ == "__main__":
    main()
