"""Finding fsdp2-frozen-root-forward-leaves-params-unsharded (torch 2.13.0, 2.14.1).

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

Run: python fsdp2-frozen-root-forward-leaves-params-unsharded.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp2-frozen-root-forward-leaves-params-unsharded.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def train(fsdp: bool):
    torch.manual_seed(0)
    model = nn.Linear(4, 4, bias=False)
    model.weight.requires_grad_(False)  # frozen at first
    if fsdp:
        fully_shard(model)
    sharded = model.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.linspace(-1.0, 1.0, 8).reshape(2, 4)
    notes = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        loss = (model(x * (1.0 + 0.25 * step)) ** 2).sum()
        if loss.requires_grad:
            loss.backward()
        opt.step()
        if step == 0:
            notes.append(f"after the frozen step model.weight is {type(model.weight).__name__}"
                         f" (the sharded parameter: {model.weight is sharded})")
            model.weight.requires_grad_(True)  # unfreeze
            notes.append(f"after unfreezing, the sharded parameter requires grad: {sharded.requires_grad}")
    w = sharded.full_tensor() if hasattr(sharded, "full_tensor") else sharded
    return w.detach().clone(), notes


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    got, notes = train(fsdp=True)
    want, _ = train(fsdp=False)
    if dist.get_rank() == 0:
        for n in notes:
            print(n)
        print(f"weight after 3 steps equals training without FSDP: {torch.allclose(got, want, rtol=1e-4, atol=1e-6)}"
              f" (max difference {float((got - want).abs().max()):.4g})")
        print("expected: DTensor (True); True; equal")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
