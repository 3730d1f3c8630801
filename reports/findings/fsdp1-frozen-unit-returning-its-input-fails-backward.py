"""fsdp-conformance reproduction: an FSDP1 unit whose parameters are all frozen and whose forward returns its input fails the backward

Found with torch 2.13.0+cpu (ci profile, thorough, seed 84: MP-DTYPES and ACCUM).

Model: root (Linear proj0, trainable; Inner model1, its own unit under
ModuleWrapPolicy({Inner})); model1's only parameter is frozen, and in this
forward model1 passes over its Linear (a branch not taken, an adapter
switched off) and returns its input. The promise (FullyShardedDataParallel
docstring: frozen parameters are supported; nothing asks a unit to use its
parameters): training runs as without FSDP. FSDP1 hooks an all-frozen unit's
reshard on its input's gradient at pre-forward
(_register_post_backward_reshard_only_hook) and its pre-backward hook on its
output at post-forward. Here both are one tensor, the reshard-only hook was
registered first and fires first, and the pre-backward hook then finds the
unit already in backward: "ValueError: expected to be in states
[<TrainingState.IDLE: 1>] but current state is TrainingState.FORWARD_BACKWARD".

Mode "uses": model1 runs its Linear; training runs (AS SPECIFIED).

Finding: fsdp1-frozen-unit-returning-its-input-fails-backward
Run: python fsdp1-frozen-unit-returning-its-input-fails-backward.py
Run: torchrun --nproc-per-node 2 fsdp1-frozen-unit-returning-its-input-fails-backward.py
Not shown by: python fsdp1-frozen-unit-returning-its-input-fails-backward.py uses: model1 uses its Linear
"""

import os
import socket
import sys

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


USES = len(sys.argv) > 1 and sys.argv[1] == "uses"


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj0 = nn.Linear(1, 1, bias=False)

    def forward(self, x):
        return self.proj0(x) if USES else x  # passes over its Linear: its input, returned


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj0 = nn.Linear(1, 1, bias=False)
        self.model1 = Inner()

    def forward(self, x):
        return self.model1(self.proj0(x))


def main():
    init()
    torch.manual_seed(0)
    model = Outer().to(DEVICE)
    model.model1.proj0.weight.requires_grad_(False)
    fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Inner}), use_orig_params=False, device_id=DEVICE)
    opt = torch.optim.SGD([p for p in fsdp.parameters() if p.requires_grad], lr=0.05)
    x = torch.randn(2, 1, device=DEVICE) * (1 + dist.get_rank())
    try:
        for _ in range(2):
            (fsdp(x) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()
    except ValueError as e:
        finish(f"backward raised ValueError: {str(e).splitlines()[0][:160]} (model1 {'uses' if USES else 'passes over'} its frozen Linear)", "")
    finish(None, f"two steps trained with model1 {'using' if USES else 'passing over'} its frozen Linear")


if __name__ == "__main__":
    main()
