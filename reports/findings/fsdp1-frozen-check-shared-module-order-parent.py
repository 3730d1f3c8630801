"""fsdp-conformance reproduction: the credited-parent form: a shared Linear first registered inside the Attention unit

Found with torch 2.13.0+cpu.

Expected (the oracle, from the FSDP spec):
  ValueError naming <root>: trainable ['3.weight'], frozen ['3.layerdict0.norm0.weight', '3.layerdict0.norm0.bias']

Finding: fsdp1-frozen-check-shared-module-order
Run: python fsdp1-frozen-check-shared-module-order-parent.py
Run: torchrun --nproc-per-node 2 fsdp1-frozen-check-shared-module-order-parent.py
"""

import ast
import os
import re
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


class ModelSeq(nn.Sequential):
    pass


class Block(nn.Module):
    pass


class LayerDict(nn.ModuleDict):
    pass


class Attention(nn.Module):
    pass


def build():
    torch.manual_seed(0)
    m0 = ModelSeq()  # <root>
    m1 = nn.Linear(1, 1, bias=False)  # 0
    m0.add_module('0', m1)
    m2 = nn.Linear(1, 1, bias=False)  # 1
    m0.add_module('1', m2)
    m3 = nn.Linear(1, 1, bias=False)  # 2
    m0.add_module('2', m3)
    m4 = Block()  # 3
    m0.add_module('3', m4)
    m4.register_parameter('weight', nn.Parameter(torch.randn(1, 1)))
    m5 = LayerDict()  # 3.layerdict0
    m4.add_module('layerdict0', m5)
    m6 = nn.LayerNorm(1)  # 3.layerdict0.norm0
    m5.add_module('norm0', m6)
    m6.weight.requires_grad_(False)
    m6.bias.requires_grad_(False)
    m7 = Attention()  # 3.layerdict0.attention1
    m5.add_module('attention1', m7)
    m7.register_parameter('weight', nn.Parameter(torch.randn(1, 1)))
    m7.weight.requires_grad_(False)
    m8 = nn.Linear(1, 1, bias=False)  # 4
    m0.add_module('4', m8)
    m7.add_module('shared0', m8)  # shared module
    policy = ModuleWrapPolicy({nn.Linear, Attention})
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


EXPECTED_ERROR = ('', ['3.weight'], ['3.layerdict0.norm0.bias', '3.layerdict0.norm0.weight'])  # the ValueError's (module, trainable, frozen): the first mixed unit in post-order


def main():
    init()
    model, policy = build()
    first, alias = first_names(model)
    try:
        FSDP(model, auto_wrap_policy=policy, device_id=DEVICE, use_orig_params=False)
        error = None
    except Exception as e:
        error = e
    wrong = []
    got = None if error is None else frozen_message(str(error), alias)
    if not isinstance(error, ValueError) or got is None or got[:3] != EXPECTED_ERROR:
        what = 'no error' if error is None else f"{type(error).__name__}: {str(error).splitlines()[0]}"
        got_text = '' if got is None else f" (naming {got[0] or '<root>'}: trainable {got[1]}, frozen {got[2]})"
        wrong.append(f"FSDP gave {what}{got_text}, expected a ValueError naming {EXPECTED_ERROR[0] or '<root>'} "
                     f"with trainable {EXPECTED_ERROR[1]} and frozen {EXPECTED_ERROR[2]}")
    finish('; '.join(wrong) or None, 'FSDP raised the ValueError naming <root> and its trainable and frozen parameters')


if __name__ == "__main__":
    main()
