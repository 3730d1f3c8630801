"""Finding: fsdp1-no-shard-unfrozen-param-loses-no-sync-grad

FSDP1 with use_orig_params=True and NO_SHARD: a parameter frozen while its
unit trains (a mixed unit: here the Linear's weight frozen, its bias
trainable), then unfrozen (progressive unfreezing), loses the gradient it
accumulates under no_sync(). While it is frozen, the pre-unshard write-back
of a later microbatch of the same step (or summon_full_params(with_grads=True))
finds its .grad None beside the unit's non-None flat gradient, zeroes its
slice and sets its _is_grad_none_mask entry. That entry is reset only in a
synchronizing post-backward (_reset_is_grad_none); a no_sync() post-backward
gives the parameter a gradient view but leaves the mask set. The next
microbatch's reshard (_use_sharded_grad_views) then reads the stale mask and
sets the parameter's .grad to None, and the pre-backward write-back zeroes
its slice of the flat gradient: the no_sync() microbatch's contribution to
that parameter is dropped, and the step differs from single-process
training. With FULL_SHARD (the control) the same schedule trains right.
Expected (FullyShardedDataParallel.no_sync docstring: 'gradients will be
accumulated in module variables, which will later be synchronized in the
first forward-backward pass after exiting the context'): the step equals
single-process training.

Run: torchrun --nproc-per-node 2 fsdp1-no-shard-unfrozen-param-loses-no-sync-grad.py
Run: python fsdp1-no-shard-unfrozen-param-loses-no-sync-grad.py (one rank: FSDP1 runs FULL_SHARD as NO_SHARD there, so the control deviates too)
"""

import contextlib
import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy


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
    warnings.simplefilter("ignore")  # FSDP's notes about NO_SHARD and the mixed unit
    rank, world = dist.get_rank(), dist.get_world_size()
    wrong = []
    for strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.FULL_SHARD):  # FULL_SHARD: the control
        torch.manual_seed(0)
        ref = nn.Linear(4, 4)
        ref.weight.requires_grad_(False)  # frozen for the first step
        model = nn.Linear(4, 4)
        model.load_state_dict(ref.state_dict())
        model.weight.requires_grad_(False)
        weight = model.weight  # the original parameter (use_orig_params=True keeps it)
        fsdp = FSDP(model, sharding_strategy=strategy, use_orig_params=True, device_id=torch.device("cpu"))
        opt, ref_opt = torch.optim.SGD(fsdp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        # step 0: the weight frozen, two synchronized microbatches; step 1: the
        # weight unfrozen, the first microbatch under no_sync()
        for step, syncs in enumerate(((True, True), (False, True))):
            if step == 1:
                weight.requires_grad_(True)
                ref.weight.requires_grad_(True)
            for k, sync in enumerate(syncs):
                xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + 10 * k + r)) for r in range(world)]
                with contextlib.nullcontext() if sync else fsdp.no_sync():
                    fsdp(xs[rank]).pow(2).sum().backward()
                (sum(ref(x).pow(2).sum() for x in xs) / world).backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(99))
        with torch.no_grad():  # the model after the steps, as a forward sees it
            err = float((fsdp(x) - ref(x)).abs().max())
        if err > 1e-5:
            wrong.append(f"{strategy.name}: the output after the unfreezing step differs from single-process training's by {err:.3g}")
    finish(wrong and "; ".join(wrong),
           "the unfrozen weight's no_sync() gradient is kept and the step equals single-process training")


if __name__ == "__main__":
    main()
