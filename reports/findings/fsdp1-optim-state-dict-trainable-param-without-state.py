"""Finding: fsdp1-optim-state-dict-trainable-param-without-state

FSDP1, use_orig_params=True: progressive unfreezing, then a checkpoint before
the next optimizer step. The unit holds `weight` (frozen for the first step)
and `proj.weight` (trained in it); after the step `weight` is unfrozen. The
optimizer has no state for `weight` yet, which torch.optim's own state_dict
handles by leaving the entry out. FSDP.optim_state_dict, and
get_state_dict / get_optimizer_state_dict over it, raise instead:
"RuntimeError: weight is not in the optimizer state. The FSDPParamInfo has
the param keys ['proj.weight', 'weight'] while the optimizer has the param
keys ['proj.weight']" (_convert_state_with_orig_params takes every parameter
of the unit that requires a gradient for one with state). One rank as two;
no checkpoint can be taken until the next step. The control: the same
unfreeze after the optimizer state dict is taken, or a step after it, works.
On two ranks, where one rank's shard holds only `weight` (its optimizer
holds no state at all), get_state_dict first gives every parameter state on
that rank (its zero-gradient step, dcp-get-state-dict-initializes-optim-state)
and the checkpoint then holds a state for `weight` that the optimizer never
had; where the ranks then differ, one raises and the other waits in a
collective. Expected (FSDP.optim_state_dict docstring, torch.optim's
state_dict): the optimizer's state, keyed by parameter names, for the
parameters that have one.

Run: python fsdp1-optim-state-dict-trainable-param-without-state.py
Run: torchrun --nproc-per-node 2 fsdp1-optim-state-dict-trainable-param-without-state.py
"""

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


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


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)  # frozen for the first step
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.proj(x @ self.weight)


def main():
    init()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    failed = []
    for unfreeze_first in (False, True):  # the control takes the state dict before unfreezing
        model = FSDP(Net(), use_orig_params=True, device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if not unfreeze_first:
            FSDP.optim_state_dict(model, opt)
        model.module.weight.requires_grad_(True)  # unfrozen: no optimizer state until the next step
        if unfreeze_first:
            try:
                FSDP.optim_state_dict(model, opt)
            except RuntimeError as e:
                failed.append(f"FSDP.optim_state_dict raised RuntimeError {' '.join(str(e).split())[:150]}")
    finish(failed and f"{'; '.join(failed)} (expected the state of the parameters that have one)",
           "the optimizer state dict is taken with a parameter unfrozen since the last step")


if __name__ == "__main__":
    main()
