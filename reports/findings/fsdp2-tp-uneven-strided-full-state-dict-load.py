"""Finding fsdp2-tp-uneven-strided-full-state-dict-load (torch 2.13.0).

Tensor parallelism + FSDP2 on a (2, 2) (dp, tp) mesh: ColwiseParallel on a
Linear(3, 6) gives each tp rank 3 rows, which fully_shard(mesh=mesh["dp"])
splits 2 / 1 over dp: the weight's placements are
(_StridedShard(dim=0, sf=2), Shard(dim=0)). get_model_state_dict(...,
StateDictOptions(full_state_dict=True)) gives the right full values, but
set_model_state_dict(model, that full state dict, full_state_dict=True)
raises a bare AssertionError on every rank (in
_StridedShard._shard_tensor, through distribute_tensor). With
Linear(3, 8) (an even split) the same load works.

Expected (torch.distributed.checkpoint.state_dict docstrings; upstream
test_fully_shard_state_dict.py 2D): a full state dict taken from a model
loads back into it (or into any model of the same parameters), uneven dims
included (DTensor and FSDP2 both allow uneven dim-0 shards).

Root cause: _distribute_state_dict rebuilds each 2-D parameter with
distribute_tensor; _StridedShard._shard_tensor splits with padding and
asserts that every padded piece has one shape, which an uneven strided
split does not give (the uneven _StridedShard gaps of pytorch#168134).

Finding: fsdp2-tp-uneven-strided-full-state-dict-load
Run: torchrun --nproc-per-node 4 fsdp2-tp-uneven-strided-full-state-dict-load.py
Not shown by: torchrun --nproc-per-node 2 fsdp2-tp-uneven-strided-full-state-dict-load.py: a (1, 2) mesh splits nothing over dp (no _StridedShard)
Not shown by: python fsdp2-tp-uneven-strided-full-state-dict-load.py: a (dp, tp) mesh needs 2 ranks at least
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

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
def main():
    init()
    world = dist.get_world_size()
    if world < 2:
        finish(None, "one rank: no (dp, tp) mesh to test (run with torchrun --nproc-per-node 4)")
    mesh = init_device_mesh(DEVICE.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Linear(3, 6).to(DEVICE)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    parallelize_module(model, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
    fully_shard(model, mesh=mesh["dp"])
    placements = tuple(model.weight.placements)
    opts = StateDictOptions(full_state_dict=True)
    sd = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in get_model_state_dict(model, options=opts).items()}
    deviation = None
    bad = [k for k in want if not torch.equal(sd[k].cpu(), want[k].cpu())]
    if bad:
        deviation = f"the full state dict's {bad} differ from the unsharded values"
    else:
        try:
            set_model_state_dict(model, {k: v.clone() for k, v in sd.items()}, options=opts)
        except AssertionError as e:
            deviation = f"set_model_state_dict(full_state_dict=True) into weight placements {placements} raised AssertionError({str(e)!r})"
    finish(deviation, f"the full state dict (weight placements {placements}) loaded back")


if __name__ == "__main__":
    main()
