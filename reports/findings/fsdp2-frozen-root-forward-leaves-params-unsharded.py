"""Finding: fsdp2-frozen-root-forward-leaves-params-unsharded

A fully_shard root group whose parameters are all frozen runs a forward (a
training step in which nothing trains yet: no backward). The root is resharded
only after backward, so the module's attributes stay the unsharded plain
Parameters instead of the sharded DTensors fully_shard registered (and the
optimizer holds). Unfreezing through the module then (progressive unfreezing:
model.weight.requires_grad_(True)) changes the unsharded tensor, not the
sharded parameter, and the training that follows differs from the same
training without FSDP. Expected (fully_shard docstring: the module's
parameters are DTensors, unsharded for forward / backward and resharded after
them): the DTensors back outside forward / backward, the unfreezing reaching
the parameters, training as without FSDP.

Run: python fsdp2-frozen-root-forward-leaves-params-unsharded.py
Run: torchrun --nproc-per-node 2 fsdp2-frozen-root-forward-leaves-params-unsharded.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
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


def train(fsdp):
    torch.manual_seed(0)  # the same model on every rank, with and without FSDP
    model = nn.Linear(4, 4, bias=False)
    model.weight.requires_grad_(False)  # frozen at first
    if fsdp:
        fully_shard(model)
    sharded = model.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.linspace(-1.0, 1.0, 8).reshape(2, 4)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        loss = (model(x * (1.0 + 0.25 * step)) ** 2).sum()
        if loss.requires_grad:
            loss.backward()
        opt.step()
        if step == 0:
            after_frozen = type(model.weight).__name__
            model.weight.requires_grad_(True)  # unfreeze
    w = sharded.full_tensor() if hasattr(sharded, "full_tensor") else sharded
    return w.detach(), after_frozen


def main():
    init()
    got, kind = train(fsdp=True)
    want, _ = train(fsdp=False)
    diff = float((got - want).abs().max())
    finish((kind != "DTensor" or diff > 1e-5) and f"after a forward of the frozen root model.weight is a {kind} (expected the sharded DTensor), "
           f"and after unfreezing the weight trained 3 steps differs from training without FSDP by {diff:.3g}",
           "the root's weight is the sharded DTensor after the frozen forward, and training matches training without FSDP")


if __name__ == "__main__":
    main()
