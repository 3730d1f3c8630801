"""Finding: fsdp2-tied-list-group-unsharded-save-segfault

FSDP2: fully_shard([b, a], reshard_after_forward=False), the supported way to
shard a Parameter tied across modules (here model[2].weight is model[3].weight,
the group given as [model[3], model[2]]: not in registration order). After a
forward with no backward yet (every parameter frozen, as in a step before
anything trains), the group stays unsharded, as reshard_after_forward=False
says. Saving then crashes the process: get_model_state_dict +
torch.distributed.checkpoint.save dies with a segmentation fault (SIGSEGV, in
FileSystemWriter reading a tensor's storage), on one rank as on two (the suite
saw rank 1 of 2 die: seed 2607). Without the tie, without the forward, or with
reshard_after_forward=True (the controls), it saves. Expected (fully_shard and
torch.distributed.checkpoint docstrings): the checkpoint saves, or a Python
error says why. Each variant runs in a child process (one gloo rank), so the
crash is reported, not suffered.

Run: python fsdp2-tied-list-group-unsharded-save-segfault.py
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


def child(tie, forward, reshard):
    with socket.socket() as s:  # one gloo rank on a free port
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    model = nn.Sequential(*[nn.Linear(7, 7, bias=False) for _ in range(4)])
    if tie:
        model[2].weight = model[3].weight
    model.requires_grad_(False)
    fully_shard([model[3], model[2]], reshard_after_forward=reshard)
    fully_shard(model)
    if forward:
        model(torch.ones(2, 7))  # no backward: nothing trains
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=tempfile.mkdtemp())
    dist.destroy_process_group()


def main():
    if len(sys.argv) > 1:
        return child(*(a == "1" for a in sys.argv[1:4]))
    failed = []
    for tie, forward, reshard in ((True, True, False), (False, True, False), (True, False, False), (True, True, True)):
        with tempfile.TemporaryDirectory() as tmp:  # the child's checkpoint (it may crash before it could remove it)
            proc = subprocess.run([sys.executable, __file__, str(int(tie)), str(int(forward)), str(int(reshard))],
                                  capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": tmp})
        if proc.returncode:
            how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            failed.append(f"tie={tie}, forward without backward={forward}, reshard_after_forward={reshard}: {how}")
    print(f"DEVIATION: dcp.save of the model crashed: {'; '.join(failed)} (expected it to save)" if failed else
          "AS SPECIFIED: dcp.save saved the model in every variant", flush=True)


if __name__ == "__main__":
    main()
