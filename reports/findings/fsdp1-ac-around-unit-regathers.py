"""Finding fsdp1-ac-around-unit-regathers (torch 2.13.0).

Activation checkpointing around an FSDP1 unit (checkpoint_wrapper on the
unit's module or on a parent of it, FSDP1 wrapping the module inside: the
order torchtitan and HF use, AC before FSDP) all-gathers that unit twice in
backward: once for the recomputed forward, once more for its own backward.
FSDP1 skips its pre- and post-forward logic in a recomputed forward only when
the unit's pre-backward hook has already run (handle state BACKWARD_PRE);
when the recompute comes first (the reentrant variant always; the
non-reentrant one when an op after the unit in the region saved its output),
the recomputed forward is a forward: all-gather, reshard (free) after it,
then the pre-backward all-gathers again. FSDP2 keeps a group unsharded after
a forward recomputed in backward (post_forward: `if not is_bw(): reshard()`):
one all-gather per group in backward, as without AC.

Expected: the same backward all-gathers with and without AC (2 here: the
two units), as FSDP2 gives.

Finding: fsdp1-ac-around-unit-regathers
Run: torchrun --nproc-per-node 2 fsdp1-ac-around-unit-regathers.py
Not shown by: python fsdp1-ac-around-unit-regathers.py: FSDP1 does not shard on one rank (nothing to all-gather)
"""

import contextlib
import os
import socket
import sys
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.block = Block()

    def forward(self, x):
        return self.block(x * self.w) * self.w  # an op after the unit, inside the region


def backward_all_gathers(where, impl):
    torch.manual_seed(0)
    model = nn.Sequential(Outer(), Outer(), nn.Linear(4, 1))
    if where == "unit":
        model[0].block = checkpoint_wrapper(model[0].block, checkpoint_impl=impl)
    elif where == "parent":
        model[0] = checkpoint_wrapper(model[0], checkpoint_impl=impl)
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    loss = model(torch.randn(3, 4, requires_grad=True)).pow(2).sum()
    calls = [0]

    def counting(orig):
        def gather(*args, **kwargs):
            calls[0] += 1
            return orig(*args, **kwargs)

        return gather

    # FSDP1 all-gathers a flat parameter with dist.all_gather (gloo), all_gather_into_tensor /
    # _all_gather_base (older releases) or all_gather_single (2.13 on): count whichever this torch has
    with contextlib.ExitStack() as stack:
        for name in ("all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_single"):
            if hasattr(dist, name):
                stack.enter_context(mock.patch.object(dist, name, counting(getattr(dist, name))))
        loss.backward()
    return calls[0]


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    if dist.get_world_size() < 2:
        print("needs 2 ranks (FSDP1 does not shard on one): torchrun --nproc-per-node 2 ...", flush=True)
    reproduced = []
    for impl in (CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT):
        for where in ("unit", "parent"):
            plain, ac = backward_all_gathers(None, impl), backward_all_gathers(where, impl)
            if dist.get_rank() == 0:
                print(f"{impl.name} checkpoint_wrapper on the {where}: backward all-gathers {plain} without AC, {ac} with AC", flush=True)
            if ac > plain:
                reproduced.append(f"{impl.name} checkpoint_wrapper on the {where}: {ac} backward all-gathers, {plain} without AC")
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"DEVIATION: activation checkpointing around an FSDP1 unit all-gathers it again in backward: {'; '.join(reproduced)}"
              if reproduced else "AS SPECIFIED: backward all-gathers each unit as often with activation checkpointing as without", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
