"""Finding: fsdp1-rank0-only-no-shard-unit-keys

FSDP1 full state dict with FullStateDictConfig(rank0_only=True) on a model
with a NO_SHARD unit (a per-module sharding_strategy, e.g. through
CustomPolicy's kwargs): ranks other than 0 get that unit's parameters in their
state dict. Expected (FullStateDictConfig docstring: "If rank0_only is True,
then only rank 0 saves the full state dict, and nonzero ranks save an empty
dict"): an empty dict on every nonzero rank.

Run: torchrun --nproc-per-node 2 fsdp1-rank0-only-no-shard-unit-keys.py
Not shown by: python fsdp1-rank0-only-no-shard-unit-keys.py: its one rank is rank 0, which gets the full state dict
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullStateDictConfig, ShardingStrategy, StateDictType
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
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0] = FSDP(model[0], sharding_strategy=ShardingStrategy.NO_SHARD, device_id=torch.device("cpu"))
    model = FSDP(model, device_id=torch.device("cpu"))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        keys = [k.replace("_fsdp_wrapped_module.", "") for k in model.state_dict()]
    finish(dist.get_rank() > 0 and keys and f"rank {dist.get_rank()}'s full state dict (rank0_only=True) has keys {keys}, expected {{}}",
           "every rank but 0 got an empty state dict")


if __name__ == "__main__":
    main()
