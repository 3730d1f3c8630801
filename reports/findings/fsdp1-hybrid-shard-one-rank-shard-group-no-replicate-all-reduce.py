"""Finding: fsdp1-hybrid-shard-one-rank-shard-group-no-replicate-all-reduce

FSDP1 with sharding_strategy=HYBRID_SHARD (or _HYBRID_SHARD_ZERO2) over a
(replicate, shard) = (n, 1) layout - a 2-D device_mesh whose shard dim has
one rank, or process_group=(a one-rank shard group, the replicate group) -
never all-reduces the gradients across the replicas: FSDP clamps the strategy
to NO_SHARD because its shard group has one rank, and NO_SHARD all-reduces
over that one-rank group. Every rank keeps its own gradient and the replicas
drift apart from the first step. Expected (ShardingStrategy docstring):
HYBRID_SHARD applies FULL_SHARD within a node and replicates parameters
across nodes, so with one rank per node it is data parallelism (DDP): the
gradients are averaged across the replicas.

Run: torchrun --nproc-per-node 2 fsdp1-hybrid-shard-one-rank-shard-group-no-replicate-all-reduce.py
Not shown by: python fsdp1-hybrid-shard-one-rank-shard-group-no-replicate-all-reduce.py: one rank has no replica to disagree with
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
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
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))  # n replicas of one rank each
    shard_groups = [dist.new_group([r]) for r in range(world)]  # every rank makes every one-rank group
    ways = {"device_mesh": {"device_mesh": mesh}, "process_group": {"process_group": (shard_groups[rank], dist.group.WORLD)}}
    wrong = []
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        for way, kwargs in ways.items():
            torch.manual_seed(0)
            model = FSDP(nn.Linear(4, 2), sharding_strategy=strategy, device_id=torch.device("cpu"), **kwargs)
            x = torch.ones(3, 4) * (1.0 + rank)  # each replica its own data
            model(x).pow(2).sum().backward()
            grad = model._flat_param.grad.detach().clone()
            grads = [torch.zeros_like(grad) for _ in range(world)]
            dist.all_gather(grads, grad)
            if not all(torch.equal(g, grads[0]) for g in grads):
                wrong.append(f"{strategy.name} via {way} (FSDP now says {model.sharding_strategy.name})")
    finish(wrong and f"the replicas' gradients differ after backward (never all-reduced across the replicate group): {'; '.join(wrong)}",
           "every replica holds the same all-reduced gradient")


if __name__ == "__main__":
    main()
