"""Finding fsdp2-tp-uneven-strided-full-state-dict-load-misplaces-rows (torch 2.8.0, 2.9.1).

Tensor parallelism + FSDP2 on a (2, 2) (dp, tp) mesh: a TP Shard(0)
parameter whose TP-local rows do not split evenly over dp (placements
(_StridedShard(0, split_factor=2), Shard(0))) is loaded from a full state
dict with set_model_state_dict(full_state_dict=True) into the wrong rows:

  RowwiseParallel Embedding(5, 5): tp piece 1 (rows 3, 4) splits 1 / 1 over
  dp, and dp rank 0 gets row 4, dp rank 1 row 3 (swapped; the other pieces
  right). ColwiseParallel Linear(2, 2): tp piece 1 (row 1) splits 1 / 0, and
  rank (dp 0, tp 1) raises "RuntimeError: Error(s) in loading state_dict ...
  output with shape [1, 2] doesn't match the broadcast shape" while the
  other ranks return: the suite's next collective then hangs.

  2.8.0, 2.9.1: as above
  2.10.0, 2.11.0, 2.12.1, 2.13.0: every rank raises a bare AssertionError
  instead (fsdp2-tp-uneven-strided-full-state-dict-load)

Expected (set_model_state_dict docstring, StateDictOptions.full_state_dict):
the full state dict loads: every rank holds its torch.chunk piece d (over dp)
of piece t (over tp) of the full tensor.

Finding: fsdp2-tp-uneven-strided-full-state-dict-load-misplaces-rows
Run: torchrun --nproc-per-node 4 fsdp2-tp-uneven-strided-full-state-dict-load-misplaces-rows.py
Not shown by: python fsdp2-tp-uneven-strided-full-state-dict-load-misplaces-rows.py: a (dp, tp) mesh needs 4 ranks here
"""

import datetime
import os
import socket
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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


def piece(x: torch.Tensor, i: int) -> torch.Tensor:
    """torch.chunk's piece i of dim 0 in two (empty past the last piece, as FSDP2 and DTensor shard)."""
    pieces = torch.chunk(x, 2, 0)
    return pieces[i] if i < len(pieces) else x[:0]


def load(model: nn.Module, full: torch.Tensor, d: int, t: int) -> str | None:
    """set_model_state_dict on a worker thread (a rank-dependent raise leaves
    no rank stuck here: the load itself issues no collective that could
    hang); what this rank holds after it, against torch.chunk's piece."""
    out = []

    def run():
        try:
            set_model_state_dict(model, {"weight": full.clone()}, options=StateDictOptions(full_state_dict=True))
            out.append(model.weight.to_local().cpu())
        except Exception as e:  # noqa: BLE001
            out.append(f"raised {type(e).__name__}: {' '.join(str(e).split())[-200:]}")

    threading.Thread(target=run, daemon=True).start()
    for _ in range(100):
        if out:
            break
        threading.Event().wait(0.1)
    want = piece(piece(full, t), d)
    if not out:
        return "did not return within 10 s"
    if isinstance(out[0], str):
        return out[0]
    return None if torch.equal(out[0], want) else f"holds rows {out[0][:, 0].tolist()} (first column), its piece is {want[:, 0].tolist()}"


def main():
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        finish(None, f"{world} ranks: the (2, 2) mesh needs 4 (run with torchrun --nproc-per-node 4)")
    mesh = init_device_mesh(DEVICE.type, (2, 2), mesh_dim_names=("dp", "tp"))
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    d, t = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    problems = []
    emb = nn.Embedding(5, 5).to(DEVICE)
    parallelize_module(emb, mesh["tp"], RowwiseParallel())
    fully_shard(emb, mesh=mesh["dp"])
    problems.append(("RowwiseParallel Embedding(5, 5)", load(emb, torch.arange(25.0, device=DEVICE).view(5, 5), d, t)))
    lin = nn.Linear(2, 2, bias=False).to(DEVICE)
    parallelize_module(lin, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
    fully_shard(lin, mesh=mesh["dp"])
    problems.append(("ColwiseParallel Linear(2, 2)", load(lin, torch.arange(4.0, device=DEVICE).view(2, 2), d, t)))
    seen = [None] * world
    dist.all_gather_object(seen, [(what, p) for what, p in problems if p], group=side)
    if rank == 0:
        found = [(what, r, p) for r, ps in enumerate(seen) for what, p in ps]
        raised_everywhere = {what for what, _, _ in found if sum(w == what and p.startswith("raised AssertionError") for w, _, p in found) == world}
        found = [f for f in found if f[0] not in raised_everywhere]  # every rank refusing alike: the other finding's form
        text = "; ".join(f"{what}: rank {r} (dp {r // 2}, tp {r % 2}) {p}" for what, r, p in found)
        others = f" ({', '.join(sorted(raised_everywhere))}: every rank raised AssertionError, fsdp2-tp-uneven-strided-full-state-dict-load)" if raised_everywhere else ""
        print(f"DEVIATION: {text}" if text else f"AS SPECIFIED: no rank loaded another rank's rows or raised alone{others}", flush=True)
    os._exit(0)  # a rank's load may have raised mid-way: no barrier on the default group


if __name__ == "__main__":
    main()
