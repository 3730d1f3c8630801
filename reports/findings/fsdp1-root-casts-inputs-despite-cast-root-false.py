"""Finding: fsdp1-root-casts-inputs-despite-cast-root-false

FSDP1 MixedPrecision(param_dtype=bfloat16, cast_forward_inputs=True,
cast_root_forward_inputs=False): the root FSDP instance casts its forward
inputs to bfloat16 where it manages parameters of its own. Expected (the
MixedPrecision docstring's note: "For the root FSDP instance, its
cast_root_forward_inputs takes precedence over its cast_forward_inputs"):
the root's forward gets its inputs as fed (float32), as it does where the root
manages no parameter, and the nested instances cast theirs
(cast_forward_inputs=True). The control, a root whose parameters all lie in a
nested instance, shows the promised behaviour on the same torch.

Run: python fsdp1-root-casts-inputs-despite-cast-root-false.py
Run: torchrun --nproc-per-node 2 fsdp1-root-casts-inputs-despite-cast-root-false.py
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision


def init():
    """torchrun sets RANK; a plain `python` run is one gloo rank on a free port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")


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
    def __init__(self, own_param: bool):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4)) if own_param else None
        self.inner = nn.Linear(4, 4)
        self.seen = None

    def forward(self, x):
        self.seen = x.dtype  # what FSDP handed the root's forward
        x = x.to(torch.bfloat16)  # the user's own cast, as FSDP promises none here
        if self.scale is not None:
            x = x * self.scale
        return self.inner(x)


def root_input_dtype(own_param: bool) -> torch.dtype:
    torch.manual_seed(0)
    model = Model(own_param)
    mp = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True, cast_root_forward_inputs=False)
    model.inner = FSDP(model.inner, mixed_precision=mp, device_id=torch.device("cpu"))
    fsdp = FSDP(model, mixed_precision=mp, device_id=torch.device("cpu"))
    fsdp(torch.ones(2, 4)).float().sum().backward()
    return model.seen


def main():
    init()
    with_params, without = root_input_dtype(True), root_input_dtype(False)
    bad = []
    if with_params != torch.float32:
        bad.append(f"the root (managing a parameter of its own) got {with_params} inputs, expected torch.float32 as fed")
    if without != torch.float32:
        bad.append(f"the control root (no parameter of its own) got {without} inputs, expected torch.float32 as fed")
    finish("; ".join(bad) or None, "the root's forward got its inputs as fed (cast_root_forward_inputs=False), with or without parameters of its own")


if __name__ == "__main__":
    main()
