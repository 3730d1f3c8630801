"""Finding: fsdp1-mp-paramless-unit-buffers-saved-low-precision

FSDP1 with MixedPrecision(buffer_dtype=torch.bfloat16): the docstring says
FSDP casts the buffers to buffer_dtype in the first forward and keeps them so,
and that "for model checkpointing, the buffers are saved in full precision
except for LOCAL_STATE_DICT". When the unit a buffer belongs to manages no
parameter of its own (here the root: ModuleWrapPolicy({Linear}) puts every
parameter in child units, the root keeps a buffer), every full or sharded
state dict holds that buffer in bfloat16: FULL_STATE_DICT, SHARDED_STATE_DICT
and get_model_state_dict (full and sharded). The child units' buffers are
float32. With one parameter in the root unit (the control) the root's buffer
is float32 too.

Run: python fsdp1-mp-paramless-unit-buffers-saved-low-precision.py
Run: torchrun --nproc-per-node 2 fsdp1-mp-paramless-unit-buffers-saved-low-precision.py
"""

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


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


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 1.0001))
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * self.scale


class Model(nn.Module):
    def __init__(self, root_param):
        super().__init__()
        self.register_buffer("shift", torch.full((4,), 1.0001))  # a root buffer, as a RoPE cache or position ids are
        self.block = Block()
        self.root_scale = nn.Parameter(torch.ones(4)) if root_param else None

    def forward(self, x):
        x = self.block(x) + self.shift
        return x * self.root_scale if self.root_scale is not None else x


def state_dicts(model):
    out = {}
    for name, kind in (("FULL_STATE_DICT", StateDictType.FULL_STATE_DICT), ("SHARDED_STATE_DICT", StateDictType.SHARDED_STATE_DICT)):
        with FSDP.state_dict_type(model, kind):
            out[name] = model.state_dict()
    out["get_model_state_dict(full)"] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return out


def main():
    init()
    warnings.simplefilter("ignore")
    wrong = []
    for root_param in (False, True):
        torch.manual_seed(0)
        model = FSDP(Model(root_param), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
        model(torch.randn(2, 4)).sum().backward()  # training: the first forward casts the buffers to bfloat16
        for way, sd in state_dicts(model).items():
            low = {k: str(v.dtype) for k, v in sd.items() if v.dtype != torch.float32}
            if low:
                wrong.append(f"root unit {'with' if root_param else 'without'} a parameter, {way}: {low}")
    finish(wrong and "buffers saved in low precision: " + "; ".join(wrong) + " (expected float32, the buffers' dtype)",
           "every state dict holds the buffers in float32")


if __name__ == "__main__":
    main()
