"""Finding fsdp1-unfreeze-frozen-unit-orig-params (torch 2.13.0).

Progressive unfreezing under FSDP1 with use_orig_params=True: a unit whose
parameters were all frozen in its first forward cannot be trained later;
after unfreezing one of its parameters (param.requires_grad_(True) on the
original parameter, which use_orig_params exposes) the next backward fails
inside FSDP with "AssertionError: Invalid: ``_post_backward_hook_state``".
A unit with one trainable parameter at wrap time unfreezes the others fine.

Expected: use_orig_params=True supports non-uniform requires_grad within a
unit (FullyShardedDataParallel docstring); single-process training (and the
mixed unit) unfreezes without error, and the gradient of the unfrozen
parameter is the single-process one.

Run: python fsdp1-unfreeze-frozen-unit-orig-params.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp1-unfreeze-frozen-unit-orig-params.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for label, frozen in (("unit all frozen at first", ("0.weight", "0.bias", "1.weight", "1.bias")), ("unit mixed at first", ("0.weight",))):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        for name, p in model.named_parameters():
            p.requires_grad_(name not in frozen)
        model = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
        x = torch.randn(2, 4)
        loss = model(x).pow(2).sum()  # step 0
        if loss.requires_grad:
            loss.backward()
        for name, p in model.named_parameters():  # step 1: unfreeze the first layer's weight
            if name.endswith("0.weight"):
                p.requires_grad_(True)
        try:
            model(x).pow(2).sum().backward()
            print(f"[rank {rank}] {label}: backward after unfreezing ran")
        except AssertionError as e:
            print(f"[rank {rank}] {label}: backward after unfreezing raised AssertionError: {str(e).splitlines()[0][:90]}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
