"""Finding fsdp2-set-model-state-dict-shared-module (torch 2.13.0).

set_model_state_dict(model, full_state_dict, StateDictOptions(full_state_dict=True))
on a fully_shard model with a module registered under two names (a shared
submodule: its parameters have two FQNs): the full tensors of the second name
are not turned into DTensors, and model.load_state_dict fails with "aten.copy_
.default got mixed torch.Tensor and DTensor" for that name. The same happens
for the meta-device init + to_empty + set_model_state_dict recipe. Expected
(set_model_state_dict docstring: loads a full state dict, as state_dict()
gives one, into an FSDP model): the values loaded, the module still shared.

Run: python fsdp2-set-model-state-dict-shared-module.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp2-set-model-state-dict-shared-module.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.shared = self.proj  # the same Linear under a second name

    def forward(self, x):
        return self.shared(self.proj(x))


def main():
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    full = {k: v.clone() for k, v in Model().state_dict().items()}
    model = Model()
    fully_shard(model)
    try:
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        ok = torch.equal(model.proj.weight.full_tensor(), full["proj.weight"])
        print(f"rank {dist.get_rank()}: loaded, values equal {ok}, still shared {model.shared is model.proj}")
    except Exception as e:
        print(f"rank {dist.get_rank()}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
