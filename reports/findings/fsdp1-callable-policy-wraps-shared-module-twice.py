"""fsdp-conformance reproduction: callable policies wrap a module registered under two names twice (_recursive_wrap has no visited set)

Found with torch 2.13.0+cpu.

Expected (the oracle, from the FSDP spec):
  FSDP unit 'p.l' manages ['p.l.weight', 'p.l.bias']
  FSDP unit '<root>' manages []

Finding: fsdp1-callable-policy-wraps-shared-module-twice
Run: python fsdp1-callable-policy-wraps-shared-module-twice.py
Run: torchrun --nproc-per-node 2 fsdp1-callable-policy-wraps-shared-module-twice.py
"""

import functools
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

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
    m1 = A()  # p
    m0.add_module('p', m1)
    m2 = nn.Linear(3, 3, bias=True)  # p.l
    m1.add_module('l', m2)
    m3 = M()  # q
    m0.add_module('q', m3)
    m3.add_module('sh', m2)  # shared module
    targets = [m2]
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: any(m is t for t in targets))
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


EXPECTED_UNITS = {'p.l': ['p.l.bias', 'p.l.weight'], '': []}  # unit path: the parameters it manages
EXPECTED_KEYS = ['p.l.bias', 'p.l.weight', 'q.sh.bias', 'q.sh.weight']  # the unwrapped model's state-dict keys


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
    for path in sorted(EXPECTED_UNITS.keys() | got.keys()):
        if path not in got or path not in EXPECTED_UNITS or len(got[path]) > 1:
            n = len(got.get(path, ()))
            wrong.append(f"module {path or '<root>'} is wrapped by {n} FSDP unit(s), expected {int(path in EXPECTED_UNITS)}")
        elif got[path][0] != EXPECTED_UNITS[path]:
            wrong.append(f"unit {path or '<root>'} manages {got[path][0]}, expected {EXPECTED_UNITS[path]}")
    managed = [f for _, fqns in mine for f in fqns]
    for f in sorted({f for f in managed if managed.count(f) > 1}):
        wrong.append(f"parameter {f} is managed by {managed.count(f)} units, expected 1")
    try:
        keys = sorted(k.replace('_fsdp_wrapped_module.', '') for k in fsdp.state_dict())
    except Exception as e:
        keys = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    if keys != EXPECTED_KEYS:
        wrong.append(f"state_dict() gave {keys}, expected {EXPECTED_KEYS}")
    finish('; '.join(wrong) or None, "FSDP wrapped the model with the expected units, each unit managing the expected parameters, the unwrapped model's state-dict keys, ties managed once and kept, a warning for each mixed unit, the same units on every rank")


if __name__ == "__main__":
    main()
