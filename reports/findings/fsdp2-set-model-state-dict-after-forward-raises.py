"""Finding: fsdp2-set-model-state-dict-after-forward-raises

After a forward with no
backward (evaluation under no_grad), FSDP2's root group keeps its unsharded
parameters registered (reshard_after_forward None -> False for the root), and
set_model_state_dict(full_state_dict=True) then raises: it builds DTensors laid
out as model.state_dict() gives them (sharded, through FSDP2's hooks) and copies
them into the registered unsharded plain tensors ("aten.copy_.default got mixed
torch.Tensor and DTensor"; for a parameter smaller than the world, "in-place
operations that require placement changes are not supported").
model.load_state_dict of a sharded state dict works; so does the same load after
a training step, or after model.reshard().

Expected: the load succeeds and the model holds the loaded values.

Run: torchrun --nproc-per-node 2 fsdp2-set-model-state-dict-after-forward-raises.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    source = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    fully_shard(model)
    with torch.no_grad():
        model(torch.randn(2, 4))  # evaluation: no backward follows
    try:
        set_model_state_dict(model, source, options=StateDictOptions(full_state_dict=True))
        model.reshard()
        ok = all(torch.equal(model.get_parameter(k).full_tensor(), v) for k, v in source.items())
        deviation = None if ok else "wrong values after the load"
    except RuntimeError as e:
        deviation = f"set_model_state_dict raised {' '.join(str(e).split())[:400]}"
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, deviation)
    if dist.get_rank() == 0:  # one verdict line, the suite's repro protocol
        found = next(((r, d) for r, d in enumerate(seen) if d), None)
        print(f"DEVIATION: rank {found[0]}: {found[1]}" if found else
              "AS SPECIFIED: set_model_state_dict(full_state_dict=True) after an evaluation forward loaded the values", flush=True)
    dist.barrier()
    os._exit(0)  # every rank leaves here, the group not torn down (gloo's teardown can abort a rank now and then)

if __name__ == "__main__":
    main()
