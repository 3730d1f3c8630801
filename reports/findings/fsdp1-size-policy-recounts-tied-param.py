"""fsdp-conformance reproduction: WRAP-UNITS

Found with torch 2.13.0+cpu.

Expected (the oracle, from the FSDP spec):
  FSDP unit 'proj0' manages ['proj0.weight']
  FSDP unit '<root>' manages []
  an error: tied proj0.weight would live in unit proj0, below the common ancestor <root>

Finding: fsdp1-size-policy-recounts-tied-param
Run: python fsdp1-size-policy-recounts-tied-param.py
Run: torchrun --nproc-per-node 2 fsdp1-size-policy-recounts-tied-param.py
"""

import functools
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

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
    setattr(m2, 'weight', m1.weight)  # tied parameter
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=1)
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


EXPECTED_UNITS = {'proj0': ['proj0.weight'], '': []}  # unit path: the parameters it manages
TIES_BELOW_LCA = [('proj0.weight', 'proj0', '')]  # (tied parameter, its unit, its users' common ancestor): FSDP must reject these


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
    if error is not None and any(w in str(error).lower() for w in ('shared', 'tied', 'tying')):
        return finish(None, f"FSDP rejected the tie below its users' common ancestor: {str(error).splitlines()[0]}")
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
    for path in sorted(EXPECTED_UNITS.keys() | got.keys()):
        if path not in got or path not in EXPECTED_UNITS or len(got[path]) > 1:
            n = len(got.get(path, ()))
            wrong.append(f"module {path or '<root>'} is wrapped by {n} FSDP unit(s), expected {int(path in EXPECTED_UNITS)}")
        elif got[path][0] != EXPECTED_UNITS[path]:
            wrong.append(f"unit {path or '<root>'} manages {got[path][0]}, expected {EXPECTED_UNITS[path]}")
    finish('; '.join(wrong) or None, 'FSDP wrapped the model with the expected units, each unit managing the expected parameters, the same units on every rank')


if __name__ == "__main__":
    main()
