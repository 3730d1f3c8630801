"""fsdp-conformance reproduction: a tied Parameter lands in a unit below its users' lowest common ancestor and FSDP accepts it silently

Found with torch 2.13.0+cpu.

Expected (the oracle, from the FSDP spec):
  FSDP unit 'a' manages ['a.l.weight', 'a.l.bias']
  FSDP unit 'b' manages ['b.l.bias']
  FSDP unit '<root>' manages ['scale', 'z.weight', 'z.bias']
  an error: tied a.l.weight would live in unit a, below the common ancestor <root>

Finding: fsdp1-tie-below-lca-not-rejected
Run: python fsdp1-tie-below-lca-not-rejected.py
Run: torchrun --nproc-per-node 2 fsdp1-tie-below-lca-not-rejected.py
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


class M(nn.Module):
    pass


class A(nn.Module):
    pass


class B(A):
    pass


def build():
    torch.manual_seed(0)
    m0 = M()  # <root>
    m0.register_parameter('scale', nn.Parameter(torch.randn(2,)))
    m1 = A()  # a
    m0.add_module('a', m1)
    m2 = nn.Linear(3, 3, bias=True)  # a.l
    m1.add_module('l', m2)
    m3 = B()  # b
    m0.add_module('b', m3)
    m4 = nn.Linear(3, 3, bias=True)  # b.l
    m3.add_module('l', m4)
    m5 = nn.Linear(2, 2, bias=True)  # z
    m0.add_module('z', m5)
    setattr(m4, 'weight', m2.weight)  # tied parameter
    policy = ModuleWrapPolicy({A})
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


def attr(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part)  # FSDP1 forwards attribute access to the wrapped module
    return obj


TIES_BELOW_LCA = [('a.l.weight', 'a', '')]  # (tied parameter, its unit, its users' common ancestor): FSDP must reject these


def main():
    init()
    model, policy = build()
    first, alias = first_names(model)
    tied = {}  # a parameter's first name: all its names
    for name, _ in model.named_parameters(remove_duplicate=False):
        tied.setdefault(alias[name], []).append(name)
    try:
        fsdp = FSDP(model, auto_wrap_policy=policy, device_id=DEVICE, use_orig_params=True)
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
    managed = [f for _, fqns in mine for f in fqns]
    for f in sorted({f for f in managed if managed.count(f) > 1}):
        wrong.append(f"parameter {f} is managed by {managed.count(f)} units, expected 1")
    for aliases in tied.values():
        if len(aliases) > 1 and len({id(attr(fsdp, a)) for a in aliases}) > 1:
            wrong.append(f"the tied names {aliases} no longer share one Parameter")
    for fqn, unit, lca in TIES_BELOW_LCA:
        wrong.append(f"tied {fqn} lives in unit {unit or '<root>'}, below its users' common ancestor {lca or '<root>'}, "
                     "and FSDP accepted it (expected an error)")
    finish('; '.join(wrong) or None, 'FSDP wrapped the model with ties managed once and kept, the same units on every rank')


if __name__ == "__main__":
    main()
