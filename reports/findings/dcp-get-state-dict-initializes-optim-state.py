"""Finding dcp-get-state-dict-initializes-optim-state (torch 2.13.0, 2.14.1).

get_state_dict / get_optimizer_state_dict on an optimizer that has no state
yet (no parameter has trained: all were frozen until now, as in a job that
unfreezes layers progressively) runs a zero-gradient optimizer step
(_init_optim_state) on the live optimizer: every parameter that requires grad
gets state it never had (SGD: a momentum buffer; Adam: step=1 and zero
moments). The saved checkpoint holds that state, the optimizer keeps it, and
Adam's next real step is its second (another bias correction than the same
training without the checkpoint). Expected (docstring: "Return the combined
state_dict for optimizers"): the optimizer's state dict, as
Optimizer.state_dict() gives it (no state), and the optimizer unchanged.

Run: python dcp-get-state-dict-initializes-optim-state.py   (one gloo rank), or
     torchrun --nproc-per-node 2 dcp-get-state-dict-initializes-optim-state.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    model.requires_grad_(False)  # frozen for now
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)  # every parameter, frozen or not
    opt.step()  # a step while everything is frozen: no gradients, no state
    model.weight.requires_grad_(True)  # unfrozen, not trained yet
    before = {n: dict(opt.state.get(p, {})) for n, p in model.named_parameters()}
    got = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    after = {n: sorted(opt.state.get(p, {})) for n, p in model.named_parameters()}
    if dist.get_rank() == 0:
        print(f"optimizer state before: {before}")
        print(f"get_optimizer_state_dict returned state for {sorted(got['state'])}: "
              f"{ {k: {s: (v.tolist() if v.dim() == 0 else tuple(v.shape)) for s, v in st.items()} for k, st in got['state'].items()} }")
        print(f"optimizer state after: {after}")
        print("expected: no state returned, the optimizer's state unchanged (empty)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
