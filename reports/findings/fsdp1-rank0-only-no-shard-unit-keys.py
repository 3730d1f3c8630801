"""Finding fsdp1-rank0-only-no-shard-unit-keys (torch 2.13.0, 2.14.1).

FSDP1 full state dict with FullStateDictConfig(rank0_only=True) on a model
with a NO_SHARD unit (a per-module sharding_strategy, e.g. through
CustomPolicy's kwargs): ranks other than 0 get that unit's parameters in
their state dict. Expected (FullStateDictConfig docstring: "If rank0_only is
True, then only rank 0 saves the full state dict, and nonzero ranks save an
empty dict"): an empty dict on every nonzero rank.

Run: torchrun --nproc-per-node 2 fsdp1-rank0-only-no-shard-unit-keys.py
     (python ... runs one gloo rank: rank 0 only, nothing to see)
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, ShardingStrategy, StateDictType


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.out = nn.Linear(2, 2)

    def forward(self, x):
        return self.out(self.proj(x))


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Model()
    model.proj = FSDP(model.proj, sharding_strategy=ShardingStrategy.NO_SHARD, device_id=torch.device("cpu"))
    model = FSDP(model, device_id=torch.device("cpu"))
    cfg = FullStateDictConfig(rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        keys = [k.replace("_fsdp_wrapped_module.", "") for k in model.state_dict()]
    print(f"rank {dist.get_rank()}: full state dict (rank0_only=True) keys {keys}")
    if dist.get_rank() == 0:
        print("expected: the model's keys on rank 0, [] on every other rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
