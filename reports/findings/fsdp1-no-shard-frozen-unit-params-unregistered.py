"""Finding: fsdp1-no-shard-frozen-unit-params-unregistered

FSDP1 with use_orig_params=True and NO_SHARD (explicitly, or FULL_SHARD on a
world of one rank, which FSDP turns into NO_SHARD): a unit whose parameters are
all frozen, whose forward inputs need no gradient but whose output does (a PEFT
LoRA decoder layer: frozen base weights, frozen embeddings before it, trainable
LoRA units nested inside; PEFT's fsdp_auto_wrap_policy builds these units). Its
pre-backward unshard swaps the original parameters for plain tensor views;
nothing reshards the unit after backward (no gradient reaches its
FlatParameter, and _catch_all_reshard takes NO_SHARD's flat parameter for
"already resharded"), so the views are never turned back into Parameters:
after one backward named_parameters() has lost the frozen parameters and the
full state_dict() raises "AssertionError: FSDP assumes ... is in the
state_dict". Expected (FullyShardedDataParallel docstring, use_orig_params):
the original parameters stay registered outside forward/backward; state_dict()
has the unwrapped model's keys. Found by the zoo (conformance/zoo/llama_lora.py).

Run: python fsdp1-no-shard-frozen-unit-params-unregistered.py
Run: torchrun --nproc-per-node 2 fsdp1-no-shard-frozen-unit-params-unregistered.py
"""

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


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


class Adapter(nn.Module):  # the trainable LoRA-like part: its own unit
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.a(x)


class Layer(nn.Module):  # a decoder layer: frozen weight, trainable adapter inside
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4, bias=False)
        self.adapter = Adapter()

    def forward(self, x):
        return self.w(x) + self.adapter(x)


def main():
    init()
    warnings.simplefilter("ignore")  # FSDP's notes about NO_SHARD
    model = nn.Sequential(nn.Linear(4, 4, bias=False), Layer())  # model[0]: frozen, the layer's input needs no gradient
    model.requires_grad_(False)
    model[1].adapter.a.weight.requires_grad_(True)
    want = list(model.state_dict())
    fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Layer, Adapter}),  # every unit uniform: no frozen-parameter error
                use_orig_params=True, sharding_strategy=ShardingStrategy.NO_SHARD, device_id=torch.device("cpu"))
    fsdp(torch.randn(2, 4)).sum().backward()
    missing = sorted(set(want) - {n.replace("_fsdp_wrapped_module.", "") for n, _ in fsdp.named_parameters()})
    try:
        keys = [k.replace("_fsdp_wrapped_module.", "") for k in fsdp.state_dict()]
        sd = "" if keys == want else f"; state_dict() keys {keys}"
    except AssertionError as e:
        sd = f"; state_dict() raised AssertionError: {str(e).splitlines()[0][:120]}"
    finish((missing or sd) and f"after one backward named_parameters() lacks {missing}{sd} (expected the unwrapped model's names and keys)",
           "after backward every original parameter is registered and state_dict() has the unwrapped model's keys")


if __name__ == "__main__":
    main()
