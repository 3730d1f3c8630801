"""Finding: fsdp2-reset-iter-state-keeps-unsynced-grads

reset_iter_state() keeps the gradients accumulated with gradient sync
disabled: microbatch 0 runs forward and backward under
set_requires_gradient_sync(False); microbatch 1's forward raises; every rank
catches it, calls reset_iter_state() on the root, sets every gradient to
None and restarts the sequence (microbatch 0 unsynced, microbatch 1 synced).
The gradients then hold microbatch 0's twice: the unsharded gradient it
accumulated survived the reset and the restarted sequence's reduce-scatter
adds it in. Expected (reset_iter_state docstring): "the failed iteration's
gradients are lost, including ... no_sync grad-accumulation state", so the
restarted sequence gives the large batch's gradients.

Run: torchrun --nproc-per-node 2 fsdp2-reset-iter-state-keeps-unsynced-grads.py
Not shown by: torchrun --nproc-per-node 2 fsdp2-reset-iter-state-keeps-unsynced-grads.py synced: microbatch 0 synchronizes its gradients before the abort
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # torch 2.4, 2.5
    from torch.distributed._composable.fsdp import FSDPModule, fully_shard


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


class Aborted(Exception):
    pass


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def main():
    init()
    synced = sys.argv[1:] == ["synced"]
    rank, world = dist.get_rank(), dist.get_world_size()
    if not hasattr(FSDPModule, "reset_iter_state"):
        finish(None, f"torch {torch.__version__} has no FSDPModule.reset_iter_state")
    ref, model = build(), build()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    gen = torch.Generator().manual_seed(1)
    xs = [[torch.randn(2, 4, generator=gen) for _ in range(world)] for _ in range(2)]  # [microbatch][rank]

    model.set_requires_gradient_sync(synced)
    (model(xs[0][rank]) ** 2).sum().backward()  # microbatch 0

    def boom(module, args, output):
        raise Aborted("forward aborted")  # e.g. an out-of-memory error, or a bad batch

    handle = model[1].register_forward_hook(boom)
    try:
        (model(xs[1][rank]) ** 2).sum().backward()  # microbatch 1, aborted
    except Aborted:
        pass
    handle.remove()
    model.reset_iter_state()
    for p in model.parameters():
        p.grad = None

    for k in range(2):  # the sequence restarted
        model.set_requires_gradient_sync(k == 1)
        (model(xs[k][rank]) ** 2).sum().backward()
    for k in range(2):  # the large batch: every rank's microbatches, the mean over ranks
        (sum((ref(x) ** 2).sum() for x in xs[k]) / world).backward()
    bad = None
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.grad.full_tensor() - q.grad).abs().max().item()
        if err > 1e-5 and bad is None:
            bad = f"{name}'s gradient is off the large batch's by {err:.3g} after reset_iter_state and the restarted sequence"
    finish(bad, "the restarted sequence gave the large batch's gradients" + (" (microbatch 0 synced before the abort)" if synced else ""))


if __name__ == "__main__":
    main()
