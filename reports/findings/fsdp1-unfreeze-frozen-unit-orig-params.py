"""Finding: fsdp1-unfreeze-frozen-unit-orig-params

Progressive unfreezing under FSDP1 with use_orig_params=True: a unit whose
parameters were all frozen in its first forward cannot be trained later; after
unfreezing one of its parameters (param.requires_grad_(True) on the original
parameter, which use_orig_params exposes) the next backward fails inside FSDP
with "AssertionError: Invalid: ``_post_backward_hook_state``". A unit with one
trainable parameter at wrap time (the control) unfreezes the others fine.
Expected: use_orig_params=True supports non-uniform requires_grad within a unit
(FullyShardedDataParallel docstring); single-process training unfreezes
without error.

Run: python fsdp1-unfreeze-frozen-unit-orig-params.py
Run: torchrun --nproc-per-node 2 fsdp1-unfreeze-frozen-unit-orig-params.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


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
    failed = []
    for label, frozen in (("all frozen", ("0.weight", "0.bias", "1.weight", "1.bias")), ("mixed", ("0.weight",))):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        for name, p in model.named_parameters():
            p.requires_grad_(name not in frozen)
        model = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
        loss = model(torch.randn(2, 4)).pow(2).sum()  # step 0
        if loss.requires_grad:
            loss.backward()
        model.module[0].weight.requires_grad_(True)  # step 1: unfreeze the first layer's weight
        try:
            model(torch.randn(2, 4)).pow(2).sum().backward()
        except AssertionError as e:
            failed.append(f"a unit {label} at first: AssertionError {str(e).splitlines()[0][:70]}")
    finish(failed and f"the backward after unfreezing a parameter raised: {'; '.join(failed)} (expected it to run)",
           "the backward after unfreezing ran")


if __name__ == "__main__":
    main()
