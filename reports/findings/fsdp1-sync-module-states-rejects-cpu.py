"""Finding fsdp1-sync-module-states-rejects-cpu (torch 2.13.0).

Every rank builds the model from its own seed; FullyShardedDataParallel(...,
sync_module_states=True, device_id=torch.device("cpu")) on gloo must make
every rank start from rank 0's parameters and buffers (the docstring: "each
FSDP module will broadcast module parameters and buffers from rank 0").
Instead every rank raises

  ValueError: The module has CPU parameters or buffers when
  `sync_module_states=True`, which requires them to be on GPU. ...

Root cause: _init_utils._check_module_states_for_sync_module_states refuses
any CPU tensor before the broadcast, whatever the backend. (With
FSDP_REPRO_BACKEND=nccl the module is on the GPU and the sync is expected to
hold: AS SPECIFIED there.)

Finding: fsdp1-sync-module-states-rejects-cpu
Run: torchrun --nproc-per-node 2 fsdp1-sync-module-states-rejects-cpu.py
Run: python fsdp1-sync-module-states-rejects-cpu.py
"""
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn

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
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def main():
    init()
    rank = dist.get_rank()
    torch.manual_seed(rank)  # every rank its own values
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).to(DEVICE)
    model.register_buffer("stat", torch.randn(3, device=DEVICE))
    torch.manual_seed(0)
    want = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).to(DEVICE)
    want.register_buffer("stat", torch.randn(3, device=DEVICE))
    deviation = None
    try:
        wrapped = FSDP(model, sync_module_states=True, device_id=DEVICE, use_orig_params=True)
        with FSDP.summon_full_params(wrapped):
            got = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone()
                   for k, v in [*wrapped.named_parameters(), *wrapped.named_buffers()]}
        bad = [k for k, v in [*want.named_parameters(), *want.named_buffers()] if not torch.equal(got[k], v)]
        if bad:
            deviation = f"rank {rank}: {bad} are not rank 0's after sync_module_states=True"
    except ValueError as e:
        deviation = f"rank {rank}: FSDP(sync_module_states=True, device_id={DEVICE}) raised ValueError: {str(e).splitlines()[0][:120]}"
    finish(deviation, "every rank holds rank 0's parameters and buffers after sync_module_states=True")


if __name__ == "__main__":
    main()
