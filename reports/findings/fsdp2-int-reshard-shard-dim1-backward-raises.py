"""Finding fsdp2-int-reshard-shard-dim1-backward-raises (torch 2.13.0).

fully_shard(module, reshard_after_forward=2, shard_placement_fn=Shard(1)) on
4 ranks: the forward reshards the Shard(1) parameters to the 2-rank
post-forward mesh, and the backward's all-gather from there raises
IndexError("list index out of range") in foreach_all_gather_copy_out. (For a
one-row matrix, [1, 8], the forward's reshard itself raises RuntimeError
"setStorage: ... out of bounds" in to_sharded_post_forward, on ranks 0 and 2
only, so the ranks then diverge: trial(2, 1, (1, 8)) shows it, not run here.)
Expected (fully_shard docstring: reshard_after_forward "If an ``int``, then
this represents the world size to reshard to after forward";
shard_placement_fn "FSDP will shard according to that placement (e.g.
Shard(1))", dim 1 divisible by the shard mesh size as required): the same
gradients as without FSDP. reshard_after_forward=True or Shard(0) with the
int both work.

A plain `python` run spawns the 4 gloo ranks itself.

Finding: fsdp2-int-reshard-shard-dim1-backward-raises
Run: torchrun --nproc-per-node 4 fsdp2-int-reshard-shard-dim1-backward-raises.py
Run: python fsdp2-int-reshard-shard-dim1-backward-raises.py
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard


def trial(reshard_after_forward, dim: int, shape=(4, 4)) -> str:
    out_f, in_f = shape
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(in_f, out_f), nn.Linear(out_f, 4))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(in_f, out_f), nn.Linear(out_f, 4))
    fully_shard(m[0], reshard_after_forward=reshard_after_forward,
                shard_placement_fn=lambda p: Shard(dim) if p.dim() == 2 else None)
    fully_shard(m)
    x = torch.linspace(-1.0, 1.0, 2 * in_f).reshape(2, in_f)
    try:
        m(x).pow(2).sum().backward()
    except Exception as e:
        return f"raised {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    ref(x).pow(2).sum().backward()  # the same input on every rank: the mean is the single-process gradient
    g = m[0].weight.grad.full_tensor()
    return f"gradient equals the unsharded model's: {torch.allclose(g, ref[0].weight.grad, atol=1e-5)}"


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    wrong = []
    for raf, dim, shape in ((2, 1, (4, 4)), (True, 1, (4, 4)), (2, 0, (4, 4))):
        got = trial(raf, dim, shape)
        if dist.get_rank() == 0:
            print(f"reshard_after_forward={raf}, Shard({dim}), weight {list(shape)}: {got}", flush=True)
        if not got.endswith(": True"):
            wrong.append(f"reshard_after_forward={raf}, Shard({dim}): {got}")
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"DEVIATION: {'; '.join(wrong)}" if wrong else
              "AS SPECIFIED: the gradients equal the unsharded model's with an int reshard_after_forward and Shard(1)", flush=True)
    print(end="", flush=True)
    os._exit(0)  # the group not torn down (gloo's teardown can abort a rank now and then)


if __name__ == "__main__":
    if "RANK" in os.environ:
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"]))
        sys.exit(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(4, port), nprocs=4)
