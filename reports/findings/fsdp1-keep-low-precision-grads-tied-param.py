"""Finding fsdp1-keep-low-precision-grads-tied-param (torch 2.13.0, 2.14.1).

FSDP1 with use_orig_params=True and MixedPrecision(param_dtype=bfloat16,
keep_low_precision_grads=True) cannot train a model with a tied parameter
(one Parameter under two names, flattened once as a shared parameter): every
backward fails in FSDP's post-backward callback with "RuntimeError: attempting
to assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype
'Float'". prepare_gradient_for_optim casts the gradient to param_dtype and
re-points the original parameters' gradients at it; for the first name it
uses the `.data` work-around meant for exactly this dtype difference, for
the tied name (_use_sharded_grad_views, `param.grad = prim_param.grad`) a
plain assignment, which the gradient dtype check rejects.

Only the ranks whose shard holds the tied parameter raise: with an
uneven model the other ranks finish the backward and go on (their next
collective then waits for the ranks that raised). The first case below
has the parameter in every rank's shard; the second puts it in the last
rank's shard only.

Expected (MixedPrecision docstring): "If True, then FSDP keeps the gradients
in the dtype used for gradient reduction" -- a backward that completes, with
low-precision gradients for the optimizer. Without the tie, or with
keep_low_precision_grads=False, the same model trains.

Run: python fsdp1-keep-low-precision-grads-tied-param.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp1-keep-low-precision-grads-tied-param.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision


class Tied(nn.Module):
    """``first`` and ``second`` share one weight; ``lead`` (parameters
    flattened before the tie) moves the tie into the last rank's shard."""

    def __init__(self, lead: int):
        super().__init__()
        self.lead = nn.Parameter(torch.randn(lead)) if lead else None
        self.first = nn.Linear(4, 4, bias=False)
        self.second = nn.Linear(4, 4, bias=False)
        self.second.weight = self.first.weight  # tied

    def forward(self, x):
        if self.lead is not None:
            x = x + self.lead.mean()
        return self.second(self.first(x))


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # lead=0: the tie in every rank's shard; lead=16 * (world - 1) + 4: in the last rank's only
    for lead, keep in ((0, False), (0, True), (16 * (world - 1) + 4, True)):
        torch.manual_seed(0)
        mp = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=keep)
        model = FSDP(Tied(lead), use_orig_params=True, mixed_precision=mp, device_id=torch.device("cpu"))
        try:
            model(torch.randn(2, 4) * (rank + 1)).float().pow(2).sum().backward()
            grads = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
            result = f"backward ran, gradients {grads}"
        except RuntimeError as e:
            result = f"RuntimeError: {str(e).splitlines()[0][:110]}"
        print(f"[rank {rank}] tie {'in every shard' if not lead else 'in the last shard'}, keep_low_precision_grads={keep}: {result}")
        # the ranks that raised left the backward after its collectives: this
        # barrier (one per case, on every rank) keeps the cases apart
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
