"""Finding fsdp1-no-shard-frozen-unit-params-unregistered (torch 2.13.0, 2.14.1).

FSDP1 with use_orig_params=True and NO_SHARD (explicitly, or FULL_SHARD on a
world of one rank, which FSDP turns into NO_SHARD): a unit whose parameters
are all frozen, whose forward inputs need no gradient but whose output does
(a PEFT LoRA decoder layer: frozen base weights, frozen embeddings before it,
trainable LoRA units nested inside; PEFT's own fsdp_auto_wrap_policy builds
exactly these units). Its pre-backward unshard swaps the original parameters
for plain tensor views; nothing reshards the unit after backward (no gradient
reaches its FlatParameter, and _catch_all_reshard takes NO_SHARD's flat
parameter for "already resharded" since it always points at its local shard),
so the views are never turned back into Parameters: after one training step
named_parameters() has lost the frozen parameters and the full state_dict()
raises "AssertionError: FSDP assumes ... is in the state_dict".

Expected (FullyShardedDataParallel docstring, use_orig_params): the module's
original parameters stay registered outside forward/backward; state_dict()
after a training step has the unwrapped model's keys.

Found by the zoo (conformance/zoo/llama_lora.py) with
peft.utils.other.fsdp_auto_wrap_policy on one rank.

Run: python fsdp1-no-shard-frozen-unit-params-unregistered.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp1-no-shard-frozen-unit-params-unregistered.py
"""

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


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


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4, bias=False)  # frozen: the layer's input needs no gradient
        self.layer = Layer()

    def forward(self, x):
        return self.layer(self.embed(x))


def main():
    if "RANK" not in os.environ:  # plain `python`: a one-process gloo group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")  # FSDP's notes about NO_SHARD on one rank
    torch.manual_seed(0)
    model = Model()
    for p in model.parameters():
        p.requires_grad_(False)
    model.layer.adapter.a.weight.requires_grad_(True)
    want = list(model.state_dict())

    fsdp = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Layer, Adapter}),  # every unit uniform: no frozen-parameter error
        use_orig_params=True,
        sharding_strategy=ShardingStrategy.NO_SHARD,
        device_id=torch.device("cpu"),
    )
    fsdp(torch.randn(2, 4)).sum().backward()

    clean = lambda n: n.replace("_fsdp_wrapped_module.", "")  # noqa: E731
    named = [clean(n) for n, _ in fsdp.named_parameters()]
    if dist.get_rank() == 0:
        print(f"named_parameters after backward: {named}")
        print(f"  missing (expected none): {sorted(set(want) - set(named))}")
    try:
        got = [clean(k) for k in fsdp.state_dict()]
        if dist.get_rank() == 0:
            print(f"state_dict() after backward: keys equal the unwrapped model's: {got == want}")
    except AssertionError as e:
        if dist.get_rank() == 0:
            print(f"state_dict() after backward raised AssertionError: {str(e).splitlines()[0][:200]}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
