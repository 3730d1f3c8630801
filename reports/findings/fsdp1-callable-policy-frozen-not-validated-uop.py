"""fsdp-conformance reproduction: callable policies (size_based/lambda/transformer) skip frozen validation: generic ValueError, no UserWarning [use_orig_params=True]

Found with torch 2.13.0+cpu.

Expected (the oracle, from the FSDP spec):
  FSDP unit 'a' manages ['a.x.weight', 'a.x.bias', 'a.y.weight', 'a.y.bias']
  FSDP unit '<root>' manages ['z.weight', 'z.bias']
  UserWarning for a: 24 numel instead of 12

Finding: fsdp1-callable-policy-frozen-not-validated
Run: python fsdp1-callable-policy-frozen-not-validated-uop.py
Run: torchrun --nproc-per-node 2 fsdp1-callable-policy-frozen-not-validated-uop.py
"""

import ast
import functools
import os
import re
import socket
import warnings

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


class M(nn.Module):
    pass


class A(nn.Module):
    pass


class B(A):
    pass


def build():
    torch.manual_seed(0)
    m0 = M()  # <root>
    m1 = A()  # a
    m0.add_module('a', m1)
    m2 = nn.Linear(3, 3, bias=True)  # a.x
    m1.add_module('x', m2)
    m3 = nn.Linear(3, 3, bias=True)  # a.y
    m1.add_module('y', m3)
    m3.weight.requires_grad_(False)
    m3.bias.requires_grad_(False)
    m4 = nn.Linear(3, 3, bias=True)  # z
    m0.add_module('z', m4)
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=24)
    return m0, policy


def first_names(model):
    """id(module or parameter) -> its first name in the unwrapped model, and
    each of its names -> the first (FSDP and torch's messages may use any)."""
    first, alias = {}, {}
    for name, obj in [*model.named_modules(remove_duplicate=False), *model.named_parameters(remove_duplicate=False)]:
        alias[name] = first.setdefault(id(obj), name)
    return first, alias


def frozen_message(text, alias):
    """torch's frozen-parameter error or warning, parsed: (module, trainable,
    frozen, total numel, trainable numel), first names; None for another text."""
    m = re.match(r"(.*?) has both parameters with requires_grad=True and False\.(.*)requires_grad=True:\n(\[.*?\])\n"
                 r".*requires_grad=False:\n(\[.*?\])\s*$", text, re.S)
    if m is None:
        return None
    n = re.search(r"\((\d+) numel instead of (\d+) numel", m[2])
    trainable, frozen = (sorted(alias.get(f, f) for f in ast.literal_eval(s)) for s in (m[3], m[4]))
    return (alias.get(m[1], m[1]), trainable, frozen, *(map(int, n.groups()) if n else (None, None)))


def units(fsdp, first, alias):
    """(unit path, the first names of the parameters it manages), in creation order."""
    out = []
    for unit in FSDP.fsdp_modules(fsdp):
        path = first[id(unit.module)]
        fqns = unit._handle.flat_param._fqns if unit._handle else ()
        out.append((path, sorted(alias[f"{path}.{f}" if path else f] for f in fqns)))
    return out


EXPECTED_WARNINGS = [('a', ['a.x.bias', 'a.x.weight'], ['a.y.bias', 'a.y.weight'], 24, 12)]  # (unit, trainable, frozen, numel, trainable numel) per mixed unit, in post-order


def main():
    init()
    model, policy = build()
    first, alias = first_names(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            fsdp = FSDP(model, auto_wrap_policy=policy, device_id=DEVICE, use_orig_params=True)
            error = None
        except Exception as e:
            fsdp, error = None, e
    wrong = []
    if error is not None:
        return finish(f"FSDP raised {type(error).__name__}: {str(error).splitlines()[0]} (expected it to wrap)", None)
    got = [frozen_message(str(w.message), alias) for w in caught]
    got = [g for g in got if g is not None]
    if got != EXPECTED_WARNINGS:
        wrong.append(f"frozen-parameter warnings {got}, expected {EXPECTED_WARNINGS}")
    mine = units(fsdp, first, alias)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if any(u != mine for u in everyone):  # (then state_dict's collectives would not match: stop here)
        return finish(f"the ranks built different FSDP units: {everyone}", None)
    got = {}
    for path, managed in mine:
        got.setdefault(path, []).append(managed)
    finish('; '.join(wrong) or None, 'FSDP wrapped the model with a warning for each mixed unit, the same units on every rank')


if __name__ == "__main__":
    main()
