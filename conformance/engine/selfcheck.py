"""Test-only scenarios that exercise the engine itself (a working group, an
error record, hangs and dying ranks); ``fault=True`` marks the ones the
in-process fake tier refuses to run."""

from __future__ import annotations

import os
import time

from conformance.case.spec import CaseSpec
from conformance.engine.scenarios import scenario


def _device():
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@scenario("echo", test_only=True)
def echo(spec: CaseSpec) -> dict:
    """Rank, world size and seed, after an all_reduce that proves the group works."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)], device=_device())
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "seed": spec.seed,
        "rank_sum": int(t.item()),
        "pid": os.getpid(),
    }


@scenario("spend-groups", test_only=True)
def spend_groups(spec: CaseSpec) -> dict:
    """A record saying the example's own groups are spent (engine.pool.SPENT):
    the pool starts fresh ranks after it."""
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "spent_process_groups": True}


@scenario("raise", test_only=True)
def raise_(spec: CaseSpec) -> dict:
    """Every rank raises: an error record, not a crash."""
    import torch.distributed as dist

    raise ValueError(f"scenario 'raise' raised on rank {dist.get_rank()} (seed {spec.seed})")


@scenario("sleep_forever", test_only=True, fault=True)
def sleep_forever(spec: CaseSpec) -> dict:
    """Rank 0 waits in a barrier that no other rank joins; the others sleep."""
    import torch.distributed as dist

    if dist.get_rank() == 0 and dist.get_world_size() > 1:
        dist.barrier()
    while True:
        time.sleep(3600)


@scenario("compute_then_reduce", test_only=True)
def compute_then_reduce(spec: CaseSpec, seconds: float = 3.0) -> dict:
    """Rank 0 computes for ``seconds`` while the others wait for it in an
    all_reduce: one rank busy, the rest blocked, no hang."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        end = time.monotonic() + seconds
        x = torch.ones(64, 64)
        while time.monotonic() < end:
            x = torch.tanh(x @ x)
    t = torch.ones(1, device=_device())
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "sum": float(t.item())}


@scenario("exit_mid_collective", test_only=True, fault=True)
def exit_mid_collective(spec: CaseSpec) -> dict:
    """Rank 1 calls os._exit(3) while rank 0 waits in an all_reduce."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(0.2)  # let rank 0 enter the collective first
        os._exit(3)
    t = torch.ones(1, device=_device())
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "sum": float(t.item())}


def _sigsegv() -> None:
    """This process dies of SIGSEGV (faulthandler dumps its stack first)."""
    import signal

    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(10)  # not reached: faulthandler dumps, then the default action


def _segfault_rank1(crash) -> dict:
    """Rank 1 dies of SIGSEGV while rank 0 waits in an all_reduce, where
    ``crash()`` holds on rank 1; else both reduce and return."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1 and crash():
        time.sleep(0.2)
        _sigsegv()
    t = torch.ones(1, device=_device())
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "sum": float(t.item())}


@scenario("segfault", test_only=True, fault=True)
def segfault(spec: CaseSpec) -> dict:
    """Rank 1 dies of SIGSEGV while rank 0 waits in an all_reduce."""
    return _segfault_rank1(lambda: True)


_ARMED: list[bool] = []  # this rank process ran "arm" (a state an earlier example left)


@scenario("arm", test_only=True)
def arm(spec: CaseSpec) -> dict:
    """Leaves this rank process armed for "crash_if_armed"."""
    _ARMED.append(True)
    return {"armed": len(_ARMED)}


@scenario("crash_if_armed", test_only=True, fault=True)
def crash_if_armed(spec: CaseSpec) -> dict:
    """As segfault, but only on a rank process that ran "arm" before: a
    crash that an earlier example set up, as a corrupted heap would."""
    return _segfault_rank1(lambda: bool(_ARMED))


@scenario("arm_fsdp1_segfault", test_only=True)
def arm_fsdp1_segfault(spec: CaseSpec) -> dict:
    """Leaves this rank process's FullyShardedDataParallel armed: from the
    next example on, rank 1 dies of SIGSEGV as FSDP1 wraps a model (a crash
    that a real scenario meets only after this example, as a corrupted heap
    would have it): what ``fsdp-conformance repro`` replays a history for."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    init = FSDP.__init__
    if not getattr(init, "_armed", False):
        def armed(self, *args, **kwargs):
            if dist.get_rank() == 1:
                _sigsegv()
            init(self, *args, **kwargs)

        armed._armed = True
        FSDP.__init__ = armed
    return {"rank": dist.get_rank(), "armed": True}


@scenario("segfault_once", test_only=True, fault=True)
def segfault_once(spec: CaseSpec, marker: str) -> dict:
    """As segfault, but only where the file ``marker`` does not exist yet
    (rank 1 creates it first): a crash that depends on what happened before
    the example, not on the case."""

    def first() -> bool:
        if os.path.exists(marker):
            return False
        open(marker, "w").close()
        return True

    return _segfault_rank1(first)
