"""Finding tp-parallelize-module-fqn-applies-to-subsequence (torch 2.8.0).

parallelize_module(model, tp_mesh, {"0.1": ColwiseParallel()}) applies the
style to model[0][1], the module the FQN names, and then to model[1] too:
its loop pops the FQN's atoms one by one at the same level, so after
recursing into "0" with the rest "1" it goes on to look up "1" among the
root's own children. The style lands on every module that a subsequence of
the FQN's atoms ending in its last one names. A Linear there is parallelized
silently; any other module raises (a ModuleList at model[0] for the plan
{"0.0": ...}: "NotImplementedError: ColwiseParallel currently only support
nn.Linear and nn.Embedding!"). PR #157182 removed the loop (2.9).

  2.8.0: {"0.1": ColwiseParallel()} parallelizes ['0.1', '1']; {"0.0": ...} on
         Sequential(ModuleList([Linear])) raises NotImplementedError
  2.9.1, 2.13.0: ['0.1'] only; the ModuleList plan parallelizes '0.0'

Expected: a plan key is a module FQN: the style applies to that module only.

Finding: tp-parallelize-module-fqn-applies-to-subsequence
Run: torchrun --nproc-per-node 2 tp-parallelize-module-fqn-applies-to-subsequence.py
Run: python tp-parallelize-module-fqn-applies-to-subsequence.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor

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


def parallelized(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), DTensor)]


def main():
    init()
    mesh = init_device_mesh(DEVICE.type, (dist.get_world_size(),))
    problems = []
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4)).to(DEVICE)
    parallelize_module(model, mesh, {"0.1": ColwiseParallel()})
    if parallelized(model) != ["0.1"]:
        problems.append(f'plan {{"0.1": ColwiseParallel()}} parallelized {parallelized(model)}')
    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4)])).to(DEVICE)
    try:
        parallelize_module(model, mesh, {"0.0": ColwiseParallel()})
        if parallelized(model) != ["0.0"]:
            problems.append(f'plan {{"0.0": ColwiseParallel()}} on Sequential(ModuleList([Linear])) parallelized {parallelized(model)}')
    except Exception as e:
        problems.append(f'plan {{"0.0": ColwiseParallel()}} on Sequential(ModuleList([Linear])) raised {type(e).__name__}: {e}')
    finish("; ".join(problems) or None, "each plan's style applied to the module its FQN names only ('0.1'; '0.0')")


if __name__ == "__main__":
    main()
