"""Finding: fsdp2-accumulated-grads-mixed-reduce-dtype

Gradient accumulation under FSDP2 mixed precision with a reduce_dtype other
than param_dtype (bfloat16 compute, float32 reduction): when a microbatch
without gradient sync leaves one parameter of a group unused (a skipped
submodule), the group's next synchronizing backward fails with
"AssertionError: FSDP reduce-scatter expects uniform gradient dtype but got
{torch.bfloat16, torch.float32}": the accumulated gradients are kept in
reduce_dtype, the fresh ones of the parameter unused before are in
param_dtype, and the reduce-scatter gets both. Expected (MixedPrecisionPolicy
docstring): with gradient sync disabled via set_requires_gradient_sync, FSDP
accumulates gradients using reduce_dtype and reduces them in reduce_dtype;
which parameters an earlier microbatch used does not matter (reduce_dtype=None,
the control, works).

Run: python fsdp2-accumulated-grads-mixed-reduce-dtype.py
Run: torchrun --nproc-per-node 2 fsdp2-accumulated-grads-mixed-reduce-dtype.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


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


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.use_b = True

    def forward(self, x):
        x = self.a(x)
        return self.b(x) if self.use_b else x


def main():
    init()
    failed = []
    for reduce_dtype in (None, torch.float32):
        model = Model()
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype))
        model.set_requires_gradient_sync(False)  # microbatch 0: b unused, no sync
        model.use_b = False
        model(torch.randn(2, 4)).float().pow(2).sum().backward()
        model.set_requires_gradient_sync(True)  # microbatch 1: everything, sync
        model.use_b = True
        try:
            model(torch.randn(2, 4)).float().pow(2).sum().backward()
        except AssertionError as e:
            failed.append(f"reduce_dtype={reduce_dtype}: AssertionError {str(e).splitlines()[0]}")
    finish(failed and f"the synchronizing backward after a no-sync microbatch that skipped b raised: {'; '.join(failed)} (expected it to run)",
           "the synchronizing backward after a no-sync microbatch that skipped b ran")


if __name__ == "__main__":
    main()
