"""fsdp-conformance reproduction: FSDP1 NO_SHARD accumulates synchronized gradients in reduce_dtype (a microbatch's contribution rounds away)

Found with torch 2.13.0+cpu (thorough profile, seed 86: MP-PIPELINE).

Model: Linear(1, 1, bias=False), weight 1, one FSDP1 unit, NO_SHARD,
MixedPrecision(param_dtype=bfloat16) (reduce_dtype: param_dtype), two
microbatches with gradient sync on in both (accumulation outside no_sync, a
supported mode: pytorch#73535). Microbatch 0's input is 1, microbatch 1's is
1/512 (both exact in bfloat16): the gradients are 1 and 1/512.

The promise (MixedPrecision docstring: reduce_dtype is "the dtype for
gradient reduction"; keep_low_precision_grads=False: "FSDP upcasts gradients
to full precision after the backward pass"): each backward's gradient is
reduced in bfloat16 and upcast to float32, where the microbatches accumulate:
1 + 1/512 = 1.001953125, which is what FULL_SHARD gives (it accumulates the
reduced shards in _saved_grad_shard, float32). NO_SHARD's post-backward
(_reduce_grad_no_shard: "runs gradient reduction (which directly covers any
gradient accumulation implicitly)") casts the whole accumulated .grad,
microbatch 0's reduced gradient included, to reduce_dtype and all-reduces it
again: bfloat16(1 + 1/512) = 1, microbatch 1's contribution lost. Each
synchronized microbatch rounds the running sum to reduce_dtype once more.

Mode "full_shard" (torchrun 2): FULL_SHARD, 1.001953125 (AS SPECIFIED). On one
rank FSDP1 runs every strategy as NO_SHARD, so that mode needs two ranks.

Finding: fsdp1-no-shard-synced-accumulation-in-reduce-dtype
Run: python fsdp1-no-shard-synced-accumulation-in-reduce-dtype.py
Run: torchrun --nproc-per-node 2 fsdp1-no-shard-synced-accumulation-in-reduce-dtype.py
Not shown by: torchrun --nproc-per-node 2 fsdp1-no-shard-synced-accumulation-in-reduce-dtype.py full_shard: FULL_SHARD accumulates in float32
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

BACKEND = os.environ.get("FSDP_REPRO_BACKEND", "gloo")  # nccl: every rank on its GPU (cuda:LOCAL_RANK)
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if BACKEND == "nccl" else torch.device("cpu")


def init():
    """torchrun sets RANK; a plain `python` run is one rank on a free port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(BACKEND)


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


STRATEGY = ShardingStrategy.FULL_SHARD if len(sys.argv) > 1 and sys.argv[1] == "full_shard" else ShardingStrategy.NO_SHARD


def main():
    init()
    model = nn.Linear(1, 1, bias=False).to(DEVICE)
    with torch.no_grad():
        model.weight.fill_(1.0)
    fsdp = FSDP(model, sharding_strategy=STRATEGY, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
                use_orig_params=True, device_id=DEVICE)
    inputs = (1.0, 1 / 512)  # the same on every rank: the mean over ranks is each rank's gradient
    for v in inputs:  # gradient sync on in both microbatches
        fsdp(torch.full((1, 1), v, device=DEVICE)).sum().backward()
    with FSDP.summon_full_params(fsdp, with_grads=True):
        got = model.weight.grad.item()
    want = sum(inputs)  # each microbatch's reduced gradient (exact in bfloat16), accumulated in float32
    where = f"{STRATEGY.name}, param_dtype bfloat16, two synchronized microbatches with gradients 1 and 1/512"
    if got != want:
        finish(f"accumulated gradient {got!r}, promised {want!r} ({where})", "")
    finish(None, f"accumulated gradient {got!r} ({where})")


if __name__ == "__main__":
    main()
