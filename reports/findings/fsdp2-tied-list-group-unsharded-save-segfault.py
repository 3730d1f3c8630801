"""Finding fsdp2-tied-list-group-unsharded-save-segfault (torch 2.13.0).

FSDP2: fully_shard([b, a], reshard_after_forward=False), the supported way to
shard a Parameter tied across modules (here model[2].weight is model[3].weight,
the group given as [model[3], model[2]]: not in registration order). After a
forward with no backward yet (every parameter frozen, as in a step before
anything trains, or a forward whose loss is not backpropagated), the group
stays unsharded, as reshard_after_forward=False says. Saving then crashes the
process: get_model_state_dict + torch.distributed.checkpoint.save dies with a
segmentation fault (SIGSEGV, in FileSystemWriter reading a tensor's storage),
on one rank as on two (the suite saw rank 1 of 2 die: seed 2607). Without the
tie, without the forward, with reshard_after_forward=True, or with the group
given in registration order ([model[2], model[3]]), it saves.

Expected (fully_shard and torch.distributed.checkpoint docstrings): the
checkpoint saves, or a Python error says why.

Run: python fsdp2-tied-list-group-unsharded-save-segfault.py   (one gloo rank;
     each variant runs in a child process, so the crash is reported, not suffered)
"""

import os
import socket
import subprocess
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard


def child(tie: bool, forward: bool, reshard: bool):
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(7, 7, bias=False) for _ in range(4)])
    if tie:
        model[2].weight = model[3].weight
    model.requires_grad_(False)
    fully_shard([model[3], model[2]], reshard_after_forward=reshard)
    fully_shard(model)
    if forward:
        model(torch.ones(2, 7))  # no backward: nothing trains
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path[0])
    dist.barrier()
    os._exit(0)


def main():
    if len(sys.argv) > 1:
        child(*(a == "1" for a in sys.argv[1:4]))
    env_rank = os.environ.get("RANK", "0")
    for tie, forward, reshard in ((True, True, False), (False, True, False), (True, False, False), (True, True, True)):
        # each rank runs the variant in a child of its own (torchrun: the
        # children form their own group on another port)
        env = dict(os.environ)
        if "MASTER_PORT" in env:
            env["MASTER_PORT"] = str(int(env["MASTER_PORT"]) + 1 + 2 * tie + 4 * forward + 8 * reshard)
        proc = subprocess.run([sys.executable, __file__, str(int(tie)), str(int(forward)), str(int(reshard))],
                              env=env, capture_output=True, text=True, timeout=120)
        what = "saved" if proc.returncode == 0 else (f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}")
        if env_rank == "0":
            print(f"tie={tie} forward-without-backward={forward} reshard_after_forward={reshard}: rank 0 {what}", flush=True)
    if env_rank == "0":
        print("expected: saved every time")


if __name__ == "__main__":
    main()
