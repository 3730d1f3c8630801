# fsdp-conformance reproduction: WRAP-STATE-DICT
# found with torch 2.13.0+cpu
# [WRAP-STATE-DICT] state_dict keys: extra ['shared0._flat_param'], missing ['shared0.weight']
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


class Model(nn.Module):
    pass


def build():
    torch.manual_seed(0)
    m0 = Model()  # <root>
    m1 = nn.Linear(1, 1, bias=False)  # proj0
    m0.add_module('proj0', m1)
    m2 = nn.Linear(1, 1, bias=False)  # proj1
    m0.add_module('proj1', m2)
    m0.add_module('shared0', m1)  # shared module
    policy = ModuleWrapPolicy({nn.Linear})
    return m0, policy, dict(use_orig_params=False)


EXPECTED = "Expected (the oracle, from the FSDP spec):\n  FSDP unit 'proj0' manages ['proj0.weight']\n  FSDP unit 'proj1' manages ['proj1.weight']\n  FSDP unit '<root>' manages []"



def show_pre_wrap_simulation():
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
    if dist.get_rank() == 0:
        show_pre_wrap_simulation()
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
    if fsdp is not None:
        keys = [k.replace("_fsdp_wrapped_module.", "") for k in fsdp.state_dict()]  # a collective: every rank
        if dist.get_rank() == 0:
            print("state_dict keys:", keys)
    if fsdp is not None:
        # the same name breaks torch.distributed.checkpoint's get_state_dict (what a
        # checkpoint save or load starts with: CKPT-RESHARD, OPTIM-STATE)
        from torch.distributed.checkpoint.state_dict import get_state_dict

        try:
            get_state_dict(fsdp, torch.optim.SGD(fsdp.parameters(), lr=0.1))
            print(f"rank {dist.get_rank()}: get_state_dict ok")
        except Exception as e:
            print(f"rank {dist.get_rank()}: get_state_dict raised {type(e).__name__}: {e}")
    if dist.get_rank() == 0:
        print(EXPECTED)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
