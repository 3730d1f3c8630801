"""Finding: fsdp2-frozen-list-group-freed-in-backward

A fully_shard([emb, b]) group (reshard_after_forward=True) whose module that
runs last in forward gives an output that needs no gradient (a frozen
Embedding looked up with constant indices), while a module that ran earlier
(a Linear with a frozen weight on an activation that needs a gradient: a's
bias trains) needs its parameters in backward: the group reshards after its
last module's forward and is not unsharded again for the backward through the
Linear, so backward raises "setStorage: ... out of bounds for storage of size
0". The same with reshard_after_forward=False when the group runs twice in one
forward (the rerun form). With b's forward under torch.utils.checkpoint
(non-reentrant), the backward through b starts with its recompute, which runs
on the group's sharded DTensor parameters ("got mixed torch.Tensor and
DTensor"; the checkpoint form). Expected (fully_shard docstring: parameters are
unsharded for forward and backward): backward runs, the gradients as the
unsharded model's.

Run: python fsdp2-frozen-list-group-freed-in-backward.py
Run: torchrun --nproc-per-node 2 fsdp2-frozen-list-group-freed-in-backward.py
"""

import copy
import functools
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint


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
    def __init__(self, runs):
        super().__init__()
        self.a = nn.Linear(1, 1)  # its bias trains: b's input needs a gradient
        self.b = nn.Linear(1, 1, bias=False)
        self.emb = nn.Embedding(1, 1)  # its output needs no gradient
        for p in (self.a.weight, self.b.weight, self.emb.weight):
            p.requires_grad_(False)
        self.runs = runs

    def forward(self, x):
        for _ in range(self.runs):  # the group [emb, b] in this order: emb runs last
            x = self.b(self.a(x)) + self.emb(torch.zeros(x.shape[0], dtype=torch.long))
        return x


def main():
    init()
    wrong = []
    for runs, reshard, ckpt in ((1, True, False), (2, False, False), (1, True, True)):
        torch.manual_seed(0)  # the same model on every rank
        model = Net(runs)
        ref = copy.deepcopy(model)
        if ckpt:  # the checkpoint form: b's forward recomputed in backward
            model.b.forward = functools.partial(checkpoint, model.b.forward, use_reentrant=False)
        fully_shard([model.emb, model.b], reshard_after_forward=reshard)
        fully_shard(model)
        x = torch.linspace(-1.0, 1.0, 2)[:, None]
        ref(x).pow(2).sum().backward()
        try:
            model(x).pow(2).sum().backward()
        except RuntimeError as e:
            wrong.append(f"group run {runs}x, reshard_after_forward={reshard}{', b checkpointed' if ckpt else ''}: "
                         f"backward raised {str(e).splitlines()[0]}")
            continue
        if not torch.allclose(model.a.bias.grad.full_tensor(), ref.a.bias.grad, atol=1e-5):
            wrong.append(f"group run {runs}x, reshard_after_forward={reshard}{', b checkpointed' if ckpt else ''}: "
                         "a.bias.grad differs from the unsharded model's")
    finish(wrong and f"a list group whose last module's output needs no gradient: {'; '.join(wrong)} (expected the unsharded model's gradients)",
           "the list group's backward gives the unsharded model's gradients")


if __name__ == "__main__":
    main()
