"""Finding: fsdp1-summon-with-grads-keep-low-precision

FSDP1 with use_orig_params=True and MixedPrecision(param_dtype=bfloat16,
keep_low_precision_grads=True): after a backward, summon_full_params(with_grads=True)
raises "RuntimeError: attempting to assign a gradient with dtype 'c10::BFloat16'
to a tensor with grad_dtype 'Float'" on every model, untied ones included.
FlatParamHandle.unshard_grad all-gathers the bf16 gradient shards and assigns the
result to the fp32 flat parameter's .grad by plain assignment, which the gradient
dtype check rejects (the post-backward path uses a `.data` work-around for the same
dtype difference). A rank whose shard is all padding has no gradient and gathers
fp32 zeros, so with a one-element parameter the ranks' all-gather sizes differ and
gloo aborts a rank instead.
Expected (summon_full_params docstring): "with_grads (bool, Optional): If True,
gradients are also unsharded with the parameters. Currently, this is only
supported when passing use_orig_params=True to the FSDP constructor and
offload_to_cpu=False to this method." -- the full gradients, in the dtype kept.
With keep_low_precision_grads=False (the control) the same call works.

Run: torchrun --nproc-per-node 2 fsdp1-summon-with-grads-keep-low-precision.py
Not shown by: python fsdp1-summon-with-grads-keep-low-precision.py: one rank holds the whole gradient (no sharded strategy, no all-gather)
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


def main():
    init()
    rank = dist.get_rank()
    failed = []
    for keep in (False, True):  # False: the control
        torch.manual_seed(0)
        mp = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=keep)
        model = FSDP(nn.Sequential(nn.Linear(7, 7), nn.Linear(7, 3)), use_orig_params=True, mixed_precision=mp,
                     device_id=torch.device("cpu"))
        model(torch.randn(2, 7) * (1 + rank)).float().pow(2).sum().backward()
        try:
            with FSDP.summon_full_params(model, writeback=False, with_grads=True):
                shapes = [tuple(p.grad.shape) for p in model.parameters() if p.grad is not None]
            if shapes != [(7, 7), (7,), (3, 7), (3,)]:
                failed.append(f"keep_low_precision_grads={keep}: full gradients of shapes {shapes}")
        except RuntimeError as e:
            failed.append(f"keep_low_precision_grads={keep}: RuntimeError {str(e).splitlines()[0][:100]}")
        dist.barrier()
    finish(failed and f"rank {rank}: summon_full_params(with_grads=True) after a backward: {'; '.join(failed)} "
                      "(expected the full gradients)",
           "summon_full_params(with_grads=True) gave the full gradients with and without keep_low_precision_grads")


if __name__ == "__main__":
    main()
