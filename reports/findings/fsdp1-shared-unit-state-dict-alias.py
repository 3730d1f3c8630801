"""fsdp-conformance reproduction: WRAP-STATE-DICT

Found with torch 2.13.0+cpu.

Expected (the oracle, from the FSDP spec):
  FSDP unit 'proj0' manages ['proj0.weight']
  FSDP unit 'proj1' manages ['proj1.weight']
  FSDP unit '<root>' manages []

Finding: fsdp1-shared-unit-state-dict-alias
Run: python fsdp1-shared-unit-state-dict-alias.py
Run: torchrun --nproc-per-node 2 fsdp1-shared-unit-state-dict-alias.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

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
    return m0, policy


def first_names(model):
    """id(module or parameter) -> its first name in the unwrapped model, and
    each of its names -> the first (FSDP and torch's messages may use any)."""
    first, alias = {}, {}
    for name, obj in [*model.named_modules(remove_duplicate=False), *model.named_parameters(remove_duplicate=False)]:
        alias[name] = first.setdefault(id(obj), name)
    return first, alias


def units(fsdp, first, alias):
    """(unit path, the first names of the parameters it manages), in creation order."""
    out = []
    for unit in FSDP.fsdp_modules(fsdp):
        path = first[id(unit.module)]
        fqns = unit._handle.flat_param._fqns if unit._handle else ()
        out.append((path, sorted(alias[f"{path}.{f}" if path else f] for f in fqns)))
    return out


EXPECTED_KEYS = ['proj0.weight', 'proj1.weight', 'shared0.weight']  # the unwrapped model's state-dict keys


def main():
    init()
    model, policy = build()
    first, alias = first_names(model)
    try:
        fsdp = FSDP(model, auto_wrap_policy=policy, device_id=DEVICE, use_orig_params=False)
        error = None
    except Exception as e:
        fsdp, error = None, e
    wrong = []
    if error is not None:
        return finish(f"FSDP raised {type(error).__name__}: {str(error).splitlines()[0]} (expected it to wrap)", None)
    mine = units(fsdp, first, alias)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if any(u != mine for u in everyone):  # (then state_dict's collectives would not match: stop here)
        return finish(f"the ranks built different FSDP units: {everyone}", None)
    got = {}
    for path, managed in mine:
        got.setdefault(path, []).append(managed)
    try:
        keys = sorted(k.replace('_fsdp_wrapped_module.', '') for k in fsdp.state_dict())
    except Exception as e:
        keys = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    if keys != EXPECTED_KEYS:
        wrong.append(f"state_dict() gave {keys}, expected {EXPECTED_KEYS}")
    finish('; '.join(wrong) or None, "FSDP wrapped the model with the unwrapped model's state-dict keys, the same units on every rank")


if __name__ == "__main__":
    main()
