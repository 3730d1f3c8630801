"""Finding fsdp2-reentrant-checkpoint-in-multi-module-group (torch 2.13.0).

fully_shard([a, b]) (one parameter group for two modules: the supported way
to shard a parameter they share) with b inside a reentrant checkpoint_wrapper
(CheckpointImpl.REENTRANT, applied before fully_shard) raises in backward:

  RuntimeError: setStorage: sizes [4, 4], strides [4, 1], storage offset 0,
  and itemsize 4 requiring a storage size of 64 are out of bounds for
  storage of size 0

b's recomputed forward and its backward run in the reentrant checkpoint's
nested autograd graph task; the group's post-backward runs there and
reshards the group (frees the unsharded parameters) while the outer backward
still has a to differentiate with them. The non-reentrant variant, and the
same model without AC, train.

When a's backward does not read the freed parameter (a is an Embedding),
nothing raises and the gradient is silently wrong: the group was
reduce-scattered in the nested backward with b's contribution only, and a's
is dropped (the script's second part: the shared weight's gradient is the
ranks' mean of b's part alone).

Expected: the gradients of the model without checkpointing.

Finding: fsdp2-reentrant-checkpoint-in-multi-module-group
Run: torchrun --nproc-per-node 2 fsdp2-reentrant-checkpoint-in-multi-module-group.py
Run: python fsdp2-reentrant-checkpoint-in-multi-module-group.py
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class User(nn.Module):
    """Reads the weight it shares with the Linear before it."""

    def __init__(self, shared):
        super().__init__()
        self.shared = shared

    def forward(self, x):
        return x + 0.5 * torch.tanh(self.shared).mean()


def train(impl):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4, bias=False)
    user = User(lin.weight)
    model = nn.Sequential(lin, user)
    if impl is not None:
        model[1] = checkpoint_wrapper(user, checkpoint_impl=impl)  # AC before FSDP, as torchtitan applies it
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard([lin, user], mesh=mesh)  # one group for the tie's two users (the module inside the wrapper)
    fully_shard(model, mesh=mesh)
    try:
        model(torch.randn(3, 4, requires_grad=True)).pow(2).sum().backward()
        return None
    except RuntimeError as e:
        return str(e).splitlines()[0][:200]


class Summing(nn.Module):
    """Reads the embedding's whole weight."""

    def __init__(self, shared):
        super().__init__()
        self.shared = shared

    def forward(self, x):
        return x + 0.5 * torch.tanh(self.shared).sum()


def embedding_grad(impl):
    """The shared weight's full gradient, a an Embedding (its backward does not read the weight)."""
    torch.manual_seed(0)
    emb = nn.Embedding(4, 4)
    user = Summing(emb.weight)
    model = nn.Sequential(emb, user)
    if impl is not None:
        model[1] = checkpoint_wrapper(user, checkpoint_impl=impl)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard([emb, user], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.tensor([[0, 1, 2]]) + dist.get_rank()).pow(2).sum().backward()  # every rank its own tokens
    return emb.weight.grad.full_tensor()


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    results = {name: train(impl) for name, impl in (("no AC", None), ("NO_REENTRANT", CheckpointImpl.NO_REENTRANT),
                                                     ("REENTRANT", CheckpointImpl.REENTRANT))}
    if dist.get_rank() == 0:
        for name, err in results.items():
            print(f"{name}: " + ("backward ok" if err is None else f"backward raised {err}"), flush=True)
    want, got = embedding_grad(None), embedding_grad(CheckpointImpl.REENTRANT)
    off = float((got - want).abs().max())
    if dist.get_rank() == 0:
        print(f"a an Embedding: the reentrant checkpoint's gradient differs from no AC's by {off:.3g}", flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        wrong = []
        if results["REENTRANT"] is not None and results["no AC"] is None:
            wrong.append(f"raises in backward: {results['REENTRANT']}")
        if off > 1e-5:
            wrong.append(f"with a an Embedding, a gradient {off:.3g} off the model without AC")
        print(f"DEVIATION: the reentrant checkpoint of a module in a multi-module FSDP2 group {'; '.join(wrong)}"
              if wrong else "AS SPECIFIED: the reentrant checkpoint of a module in the group trains as without AC", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
