# fsdp-conformance reproduction: FROZEN-ERROR
# found with torch 2.13.0+cpu
# [FROZEN-ERROR] ValueError names module block1.block2.adapter1.norm2, expected block1.proj0
# (form 2, build_parent: the thorough profile's case: a shared module's parent unit credited with its parameters)
# run: python repro.py   or   torchrun --nproc-per-node 2 repro.py

import functools
import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)


class ModelDict(nn.ModuleDict):
    pass


class Block(nn.Module):
    pass


class Layer(nn.Module):
    pass


class Attention(nn.Module):
    pass


class MLPSeq(nn.Sequential):
    pass


class Adapter(nn.Module):
    pass


def build():
    torch.manual_seed(0)
    m0 = ModelDict()  # <root>
    m1 = nn.ModuleList()  # modulelist0
    m0.add_module('modulelist0', m1)
    m2 = Block()  # block1
    m0.add_module('block1', m2)
    m3 = nn.Linear(1, 1, bias=True)  # block1.proj0
    m2.add_module('proj0', m3)
    m3.weight.requires_grad_(False)
    m4 = Layer()  # block1.layer1
    m2.add_module('layer1', m4)
    m5 = Attention()  # block1.layer1.attention0
    m4.add_module('attention0', m5)
    m6 = Block()  # block1.block2
    m2.add_module('block2', m6)
    m7 = MLPSeq()  # block1.block2.mlpseq0
    m6.add_module('mlpseq0', m7)
    m8 = Adapter()  # block1.block2.adapter1
    m6.add_module('adapter1', m8)
    m9 = nn.Linear(1, 1, bias=False)  # block1.block2.adapter1.proj0
    m8.add_module('proj0', m9)
    m9.weight.requires_grad_(False)
    m10 = nn.Linear(1, 1, bias=False)  # block1.block2.adapter1.proj1
    m8.add_module('proj1', m10)
    m10.weight.requires_grad_(False)
    m11 = nn.LayerNorm(1)  # block1.block2.adapter1.norm2
    m8.add_module('norm2', m11)
    m11.weight.requires_grad_(False)
    m0.add_module('shared0', m3)  # shared module
    policy = ModuleWrapPolicy({nn.Module})
    return m0, policy, dict(use_orig_params=False)


EXPECTED = "Expected (the oracle, from the FSDP spec):\n  ValueError naming block1.proj0: trainable ['block1.proj0.bias'], frozen ['block1.proj0.weight']"



class ModelSeq(nn.Sequential):
    pass


class LayerDict(nn.ModuleDict):
    pass


def build_parent():
    """Second form (the thorough profile, torch 2.13.0): the shared Linear is
    first registered inside the Attention unit (attention1.shared0), last at
    the root ('4'). The simulation visits it at '4', after attention1, so it
    credits attention1 (frozen weight) with the Linear's trainable weight:
    attention1 reported as mixed, while the unit that mixes is the root
    ('3.weight' trainable, the LayerNorm frozen)."""
    torch.manual_seed(0)
    m0 = ModelSeq()
    for i in range(3):
        m0.add_module(str(i), nn.Linear(1, 1, bias=False))
    m4 = Block()
    m0.add_module('3', m4)
    m4.register_parameter('weight', nn.Parameter(torch.randn(1, 1)))
    m5 = LayerDict()
    m4.add_module('layerdict0', m5)
    m6 = nn.LayerNorm(1)
    m5.add_module('norm0', m6)
    m6.weight.requires_grad_(False)
    m6.bias.requires_grad_(False)
    m7 = Attention()
    m5.add_module('attention1', m7)
    m7.register_parameter('weight', nn.Parameter(torch.randn(1, 1)))
    m7.weight.requires_grad_(False)
    m8 = nn.Linear(1, 1, bias=False)
    m0.add_module('4', m8)
    m7.add_module('shared0', m8)  # shared module: first registered here
    return m0, ModuleWrapPolicy({nn.Linear, Attention}), dict(use_orig_params=False)


EXPECTED_PARENT = "Expected (the oracle, from the FSDP spec):\n  ValueError naming <root>: trainable ['3.weight'], frozen ['3.layerdict0.norm0.weight', '3.layerdict0.norm0.bias']"


def show_pre_wrap_simulation(build=build):
    """What torch's helpers behind _validate_frozen_params say each unit will manage."""
    from torch.distributed.fsdp._wrap_utils import _get_managed_param_to_fqn, _get_post_order_named_modules

    model, policy, kwargs = build()
    if not hasattr(policy, "_run_policy"):
        return  # callable policies are not simulated by torch
    ignored = {p for m in kwargs.get("ignored_modules", []) for p in m.parameters()} | set(kwargs.get("ignored_states", []))
    targets = set(policy._run_policy(model, set(kwargs.get("ignored_modules", [])), {})) | {model}
    visited = set()
    for name, module in _get_post_order_named_modules(model):
        if module in targets:
            managed = _get_managed_param_to_fqn(module, ignored, visited, name)
            print(f"pre-wrap simulation: unit {name or '<root>'!r} would manage {list(managed.values())}")


def main():
    if "RANK" not in os.environ:  # plain `python`: a one-process gloo group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    for form, (build_fn, expected) in enumerate(((build, EXPECTED), (build_parent, EXPECTED_PARENT))):
        if dist.get_rank() == 0:
            print(f"--- form {form + 1}")
        one(build_fn, expected)
    dist.barrier()
    dist.destroy_process_group()


def one(build, expected):
    if dist.get_rank() == 0:
        show_pre_wrap_simulation(build)
    model, policy, kwargs = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fsdp = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), **kwargs)
        except Exception as e:
            fsdp = None
            print(f"FSDP raised {type(e).__name__}: {e}")
    for w in caught:
        print(f"{w.category.__name__}: {w.message}")
    if fsdp is not None and dist.get_rank() == 0:
        for name, unit in fsdp.named_modules():
            if isinstance(unit, FSDP):
                name = name.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")
                fqns = list(unit._handle.flat_param._fqns) if unit._handle else []
                print(f"FSDP unit {name or '<root>'!r} manages {fqns}")
        print("state_dict keys:", [k.replace("_fsdp_wrapped_module.", "") for k in fsdp.state_dict()])
    if dist.get_rank() == 0:
        print(expected)


if __name__ == "__main__":
    main()
