"""Finding: fsdp1-mp-state-dict-before-forward-rounds-buffers

FSDP1 with MixedPrecision(buffer_dtype=torch.bfloat16): the docstring says
FSDP casts the buffers to buffer_dtype "in the first forward pass and keeps
them in that dtype thereafter", and that checkpoints save them in full
precision. A state dict taken before any forward (a checkpoint right after
wrapping, e.g. converting pretrained weights to FSDP's format) runs FSDP's
lazy initialization, which casts every buffer to bfloat16 already: the
checkpoint holds the buffers' values rounded through bfloat16 (1.0001 -> 1.0),
and the model's buffers stay bfloat16 although no forward ran. The control,
the same model without buffer_dtype, saves 1.0001.

Run: python fsdp1-mp-state-dict-before-forward-rounds-buffers.py
Run: torchrun --nproc-per-node 2 fsdp1-mp-state-dict-before-forward-rounds-buffers.py
"""

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, StateDictType


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
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 1.0001))

    def forward(self, x):
        return self.proj(x) * self.scale


def main():
    init()
    warnings.simplefilter("ignore")
    wrong = []
    for buffer_dtype in (torch.bfloat16, None):
        model = FSDP(Model(), device_id=torch.device("cpu"), mixed_precision=MixedPrecision(buffer_dtype=buffer_dtype))
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            saved = model.state_dict()["scale"]  # no forward has run
        live = dict(model.named_buffers())["_fsdp_wrapped_module.scale"].dtype
        if not torch.equal(saved, torch.full((4,), 1.0001)) or live != torch.float32:
            wrong.append(f"buffer_dtype={buffer_dtype}: the state dict holds scale={saved.tolist()} ({saved.dtype}), "
                         f"expected 1.0001 (float32); the model's buffer is {live} after it")
    finish(wrong and "a state dict before the first forward: " + "; ".join(wrong),
           "the state dict holds the buffers' values as built, the model's buffers unchanged")


if __name__ == "__main__":
    main()
