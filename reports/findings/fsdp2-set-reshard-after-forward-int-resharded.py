"""Finding fsdp2-set-reshard-after-forward-int-resharded (torch 2.13.0).

fully_shard(module, reshard_after_forward=2) on 4 ranks: after a forward with
no backward (an eval forward under torch.no_grad(), or a microbatch whose loss
needs no gradient) the group stays resharded to its 2-rank post-forward mesh;
backward is what reshards it to the full mesh. Calling
set_reshard_after_forward then, the very use its docstring gives ("set an FSDP
module's value to False for running evals and set back to True for
training"), replaces the group's post-forward mesh while its parameters are
still sharded over it:

- set_reshard_after_forward(False): the next forward raises
  AssertionError("Expected mesh_info to be FSDPMeshInfo, got NoneType");
- set_reshard_after_forward(True): the next forward all-gathers the 2-rank
  shards over all 4 ranks: twice the data, into an output torch resizes with
  a deprecation UserWarning ("An output with one or more elements was resized
  ... outputs will not be resized" in a future release); the parameters come
  out right only because the first half of the doubled output is them.

Expected: the next forward all-gathers what the group holds (over the 2 ranks
it is sharded over) and computes as without FSDP, whatever the new setting.

A plain `python` run spawns the 4 gloo ranks itself.

Finding: fsdp2-set-reshard-after-forward-int-resharded
Run: torchrun --nproc-per-node 4 fsdp2-set-reshard-after-forward-int-resharded.py
Run: python fsdp2-set-reshard-after-forward-int-resharded.py
"""

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def trial(setting: bool) -> str:
    ref = model()
    m = model()
    fully_shard(m[0], reshard_after_forward=2)
    fully_shard(m)
    x = torch.linspace(-1.0, 1.0, 8).reshape(2, 4)
    with torch.no_grad():
        m(x)  # eval forward: m[0] is left sharded over 2 ranks
        m.set_reshard_after_forward(setting)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = m(x)
        except Exception as e:
            return f"raised {type(e).__name__}: {e}", True
        want = ref(x)
    resized = sum("was resized" in str(w.message) for w in caught)
    equal = torch.allclose(out, want, atol=1e-6)
    return (f"output equals the unsharded model's: {equal}; all-gather outputs resized (twice the data gathered): {resized}",
            not equal or resized > 0)


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    wrong = []
    for setting in (False, True):
        got, deviates = trial(setting)
        if dist.get_rank() == 0:
            print(f"set_reshard_after_forward({setting}) after an eval forward: {got}", flush=True)
        if deviates:
            wrong.append(f"set_reshard_after_forward({setting}) after an eval forward of an int-resharded group: {got}")
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"DEVIATION: {'; '.join(wrong)}" if wrong else
              "AS SPECIFIED: after either setting the next forward equals the unsharded model's and gathers what the group holds",
              flush=True)
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
