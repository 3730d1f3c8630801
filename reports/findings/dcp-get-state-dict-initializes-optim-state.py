"""Finding: dcp-get-state-dict-initializes-optim-state

get_state_dict / get_optimizer_state_dict on an optimizer that has no state
yet (no parameter has trained: all were frozen until now, as in a job that
unfreezes layers progressively) runs a zero-gradient optimizer step
(_init_optim_state) on the live optimizer: every parameter that requires grad
gets state it never had (Adam: step=1 and zero moments). The checkpoint holds
that state, the optimizer keeps it, and Adam's next real step is its second.
Expected (docstring: "Return the combined state_dict for optimizers"): the
optimizer's state dict as Optimizer.state_dict() gives it (no state), and the
optimizer unchanged.

Run: python dcp-get-state-dict-initializes-optim-state.py
Run: torchrun --nproc-per-node 2 dcp-get-state-dict-initializes-optim-state.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard


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


def main():
    init()
    model = nn.Linear(4, 4)
    model.requires_grad_(False)  # frozen for now
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)  # every parameter, frozen or not
    opt.step()  # a step while everything is frozen: no gradients, no state
    model.weight.requires_grad_(True)  # unfrozen, not trained yet
    got = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    after = {n: sorted(opt.state.get(p, {})) for n, p in model.named_parameters() if opt.state.get(p)}
    bad = f"it returned state for {sorted(got['state'])} and left the optimizer with {after}" if got["state"] or after else None
    finish(bad and f"get_optimizer_state_dict on an optimizer without state initialized it: {bad}, expected no state and the optimizer unchanged",
           "get_optimizer_state_dict returned no state and left the optimizer without state")


if __name__ == "__main__":
    main()
