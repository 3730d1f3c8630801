"""Finding fsdp2-forward-method-calls-self (torch 2.13.0, 2.14.1).

register_fsdp_forward_method runs FSDP's pre/post-forward around a user
method; when the method calls self(...) (HF generate() calls the model's
forward), the inner call's post-forward hook runs while the method is still
running, and the hooks are not reentrant:

1. reshard_after_forward=True: the inner post-forward reshards the module's
   parameters mid-method: the rest of the method sees sharded DTensors
   (wrong results, or "mixed torch.Tensor and DTensor" errors).
2. reshard_after_forward=False (the root's default): the inner post-forward
   leaves the group IDLE, so the outer post-forward reshards unconditionally
   (FSDPParamGroup.reshard only honours reshard_after_forward in FORWARD
   state): after the method the parameters are sharded, the next forward
   all-gathers again, and backward through the method's output can fail
   ("setStorage: ... out of bounds for storage of size 0").

Expected (spec source 004, register_fsdp_forward_method docstring): the
module's parameters stay unsharded for the whole method, and after it they
are resharded as reshard_after_forward says.

Run: python fsdp2-forward-method-calls-self.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp2-forward-method-calls-self.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return F.linear(x, self.weight)

    def generate(self, x):
        y = self(x)  # the model's own forward, as HF generate() does
        kind = type(self.weight).__name__  # Parameter (unsharded) or DTensor (sharded)
        return y, kind


def main():
    if "RANK" not in os.environ:  # plain `python`: a one-process gloo group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    x = torch.randn(2, 4)

    # 1. a non-root module, reshard_after_forward=True
    root = nn.Sequential(Block(), nn.Linear(4, 4))
    fully_shard(root[0], reshard_after_forward=True)
    fully_shard(root)
    register_fsdp_forward_method(root[0], "generate")
    root(x)  # lazy init through the root
    _, kind = root[0].generate(x)
    print(f"[1] inside generate(), after self(x): weight is a {kind} (expected Parameter, i.e. unsharded)")

    # 2. the root, reshard_after_forward=False (its default)
    model = Block()
    fully_shard(model)
    register_fsdp_forward_method(model, "generate")
    y, kind = model.generate(x)
    print(f"[2] after generate(): weight is a {type(model.weight).__name__} (expected Parameter: the root does not reshard)")
    try:
        y.sum().backward()
        print("[2] backward through generate()'s output: ok")
    except RuntimeError as e:
        print(f"[2] backward through generate()'s output raised: {str(e).splitlines()[0]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
