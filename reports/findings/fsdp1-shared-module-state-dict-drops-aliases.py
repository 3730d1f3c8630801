"""Finding fsdp1-shared-module-state-dict-drops-aliases (torch 2.13.0, 2.14.1).

FSDP1, use_orig_params=False: a module registered under several names (T5's
`shared` embedding is also encoder.embed_tokens and decoder.embed_tokens)
that is not itself an FSDP unit, whose parameter is flattened into the unit
that reaches it first. Flattening replaces the module's Parameter with a plain
tensor attribute, so under every other name (here `shared.weight` at the root
and `b.emb.weight` in another unit) the parameter is gone from the full
state_dict: the checkpoint misses keys the unwrapped model has, and loading it
with strict=True into the unwrapped model fails. With use_orig_params=True the
keys are complete.

The optimizer sees the same flattening: the optimizer state dict
(FSDP.optim_state_dict, get_state_dict / get_optimizer_state_dict) keys the
parameter by its name inside the unit (`block.shared.weight` below), not by
its first name (`proj.weight`, as the unwrapped model, use_orig_params=True
and FSDP2 do), in `state` and in `param_groups`. A checkpoint saved with
torch.distributed.checkpoint under FSDP2 then does not load into the FSDP1
model: dcp.load asks for optim.state.block.shared.weight.momentum_buffer
("Missing key in checkpoint state_dict"; when the parameter has no state at
the load, the param_groups name it block.shared.weight instead of
proj.weight).

Expected (FullyShardedDataParallel state_dict, FULL_STATE_DICT): the keys of
the unwrapped model's state_dict; (get_state_dict docstring: state dicts that
"can be resharded with a different number of trainers and/or different
parallelisms", FSDP1 and FSDP2) the optimizer state under the FQNs the
unwrapped model and FSDP2 use. Related but different:
fsdp1-shared-unit-state-dict-alias (the shared module itself is a unit: its
second name gets '<name>._flat_param'). In T5 under ModuleWrapPolicy({T5Stack})
the same wrap also places the shared parameter below its users' common
ancestor (fsdp1-tie-below-lca-not-rejected), so forward then fails too.

Run: python fsdp1-shared-module-state-dict-drops-aliases.py   (one gloo rank), or
     torchrun --nproc-per-node 2 fsdp1-shared-module-state-dict-drops-aliases.py
"""

import os
import socket
import warnings

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Stack(nn.Module):  # T5Stack: the wrap unit; its embedding is shared
    def __init__(self, emb):
        super().__init__()
        self.emb = emb
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.proj(self.emb(x))


class Model(nn.Module):
    pass


def build():
    torch.manual_seed(0)
    model = Model()
    emb = nn.Embedding(8, 4)
    model.shared = emb  # one module, three names
    model.a = Stack(emb)
    model.b = Stack(emb)
    return model


class Block(nn.Module):  # the wrap unit; it reaches the root's proj under another name
    def forward(self, x):
        return self.shared(x)


class Net(nn.Module):
    def forward(self, x):
        return self.block(self.proj(x))


def net():
    torch.manual_seed(0)
    model = Net()
    model.proj = nn.Linear(4, 4, bias=False)  # first name: proj.weight
    model.block = Block()
    model.block.shared = model.proj  # second name: block.shared.weight
    return model


def optimizer_names():
    """get_state_dict's optimizer keys per API, then FSDP2 save -> FSDP1 load."""
    for api in ("unwrapped", "fsdp2", "fsdp1 use_orig_params=True", "fsdp1 use_orig_params=False"):
        model = net()
        if api == "fsdp2":
            fully_shard(model)
        elif api != "unwrapped":
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=api.endswith("True"), device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _, osd = get_state_dict(model, opt)  # (initializes the state: a zero-gradient step)
        if dist.get_rank() == 0:
            print(f"{api}: optimizer state for {sorted(osd['state'])}, param_groups {[g['params'] for g in osd['param_groups']]}")
    if dist.get_rank() == 0:
        print("expected: ['proj.weight'] every time")
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    try:
        model = net()
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path[0])
        model = FSDP(net(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=False, device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        try:
            dcp.load(state, checkpoint_id=path[0])
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            print(f"rank {dist.get_rank()}: FSDP2 checkpoint loaded into FSDP1 (use_orig_params=False)")
        except BaseException as e:  # CheckpointException derives from BaseException
            print(f"rank {dist.get_rank()}: FSDP2 -> FSDP1 dcp.load raised {type(e).__name__}: ...{' '.join(str(e).split())[-100:]}")
        if dist.get_rank() == 0:
            print("expected: loaded, with proj.weight's momentum")
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


def main():
    if "RANK" not in os.environ:  # plain `python`: a one-process gloo group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    for use_orig_params in (False, True):
        model = build()
        want = list(model.state_dict())
        fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Stack}), use_orig_params=use_orig_params, device_id=torch.device("cpu"))
        got = [k.replace("_fsdp_wrapped_module.", "") for k in fsdp.state_dict()]
        if dist.get_rank() == 0:
            print(f"use_orig_params={use_orig_params}: state_dict missing {sorted(set(want) - set(got))} (expected none), extra {sorted(set(got) - set(want))}")
    optimizer_names()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
