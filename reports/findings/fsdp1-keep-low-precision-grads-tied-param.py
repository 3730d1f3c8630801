"""Finding: fsdp1-keep-low-precision-grads-tied-param

FSDP1 with use_orig_params=True and MixedPrecision(param_dtype=bfloat16,
keep_low_precision_grads=True) cannot train a model with a tied parameter (one
Parameter under two names, flattened once): every backward fails in FSDP's
post-backward callback with "RuntimeError: attempting to assign a gradient
with dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'".
prepare_gradient_for_optim casts the gradient to param_dtype and re-points the
original parameters' gradients at it; for the first name it uses the `.data`
work-around meant for this dtype difference, for the tied name
(_use_sharded_grad_views, `param.grad = prim_param.grad`) a plain assignment,
which the gradient dtype check rejects. Only the ranks whose shard holds the
tied parameter raise: the second case puts it in the last rank's shard only.
Expected (MixedPrecision docstring): "If True, then FSDP keeps the gradients in
the dtype used for gradient reduction" -- a backward that completes. With
keep_low_precision_grads=False (the control) the same model trains.

Run: python fsdp1-keep-low-precision-grads-tied-param.py
Run: torchrun --nproc-per-node 2 fsdp1-keep-low-precision-grads-tied-param.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision


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


class Tied(nn.Module):
    """``first`` and ``second`` share one weight; ``lead`` (flattened before
    the tie) moves the tie into the last rank's shard."""

    def __init__(self, lead):
        super().__init__()
        self.lead = nn.Parameter(torch.randn(lead))
        self.first = nn.Linear(4, 4, bias=False)
        self.second = nn.Linear(4, 4, bias=False)
        self.second.weight = self.first.weight  # tied

    def forward(self, x):
        return self.second(self.first(x + self.lead.sum()))


def main():
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = []
    # lead=0: the tie in every rank's shard; 16 * (world - 1) + 4: in the last rank's only
    for lead, keep in ((0, False), (0, True), (16 * (world - 1) + 4, True)):
        mp = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=keep)
        model = FSDP(Tied(lead), use_orig_params=True, mixed_precision=mp, device_id=torch.device("cpu"))
        try:
            model(torch.randn(2, 4)).float().pow(2).sum().backward()
        except RuntimeError as e:
            failed.append(f"keep_low_precision_grads={keep}, lead {lead}: RuntimeError {str(e).splitlines()[0][:100]}")
        dist.barrier()  # the ranks that raised left after the backward's collectives: keeps the cases apart
    finish(failed and f"rank {rank}: the backward of a tied model failed: {'; '.join(failed)} (expected it to complete)",
           "every backward of the tied model completed")


if __name__ == "__main__":
    main()
