"""Finding: fsdp2-forward-method-calls-self

register_fsdp_forward_method runs FSDP's pre/post-forward around a user
method; when the method calls self(...) (HF generate() calls the model's
forward), the inner call's post-forward hook runs while the method is still
running, and the hooks are not reentrant:
1. reshard_after_forward=True: the inner post-forward reshards the module's
   parameters mid-method: the rest of the method sees sharded DTensors (wrong
   results, or "mixed torch.Tensor and DTensor" errors).
2. reshard_after_forward=False (the root's default): the inner post-forward
   leaves the group IDLE, so the outer post-forward reshards unconditionally:
   after the method the parameters are sharded, and backward through the
   method's output can fail ("setStorage: ... out of bounds").
Expected (register_fsdp_forward_method docstring): the module's parameters stay
unsharded for the whole method, and after it they are resharded as
reshard_after_forward says.

Run: python fsdp2-forward-method-calls-self.py
Run: torchrun --nproc-per-node 2 fsdp2-forward-method-calls-self.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method


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


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return F.linear(x, self.weight)

    def generate(self, x):
        y = self(x)  # the model's own forward, as HF generate() does
        return y, type(self.weight).__name__  # Parameter (unsharded) or DTensor (sharded)


def main():
    init()
    x = torch.randn(2, 4)
    wrong = []
    root = nn.Sequential(Block(), nn.Linear(4, 4))  # 1. a non-root module, reshard_after_forward=True
    fully_shard(root[0], reshard_after_forward=True)
    fully_shard(root)
    register_fsdp_forward_method(root[0], "generate")
    root(x)  # lazy init through the root
    _, kind = root[0].generate(x)
    if kind != "Parameter":
        wrong.append(f"inside generate(), after self(x), the weight is a {kind} (expected unsharded)")
    model = Block()  # 2. the root, reshard_after_forward=False
    fully_shard(model)
    register_fsdp_forward_method(model, "generate")
    y, _ = model.generate(x)
    if type(model.weight).__name__ != "Parameter":
        wrong.append(f"after the root's generate() its weight is a {type(model.weight).__name__} (expected unsharded: the root does not reshard)")
    try:
        y.sum().backward()
    except RuntimeError as e:
        wrong.append(f"backward through generate()'s output raised {str(e).splitlines()[0][:90]}")
    finish(wrong and f"a registered method that calls self(...): {'; '.join(wrong)}",
           "the parameters stay unsharded through the method and as reshard_after_forward says after it")


if __name__ == "__main__":
    main()
