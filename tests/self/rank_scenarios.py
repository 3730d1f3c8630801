"""Test-only scenarios of the suite's rank-side helpers: the StallGuard
(conformance.areas.common.stall; tests/self/test_stall.py), two ranks on a
guarded group of their own, one of them diverging (a collective the other
never matches) or slow (busy on CPU before it enters the same collective);
and the agreement channel (conformance.engine.agree; tests/self/test_agree.py)."""

import datetime
import time

import torch
import torch.distributed as dist

from conformance.areas.common import ranks, stall
from conformance.engine import agree
from conformance.engine.scenarios import scenario

# far beyond the guard's second: a collective that ends before it did not time out
GROUP_TIMEOUT = 30.0


def _guarded(body) -> dict:
    group, fds = stall.new_group(datetime.timedelta(seconds=GROUP_TIMEOUT))
    dist.all_reduce(torch.ones(1), group=group)  # the group works
    t0 = time.perf_counter()
    error = None
    with stall.StallGuard(group, fds) as guard:
        try:
            body(group)
        except RuntimeError as e:
            error = str(e).splitlines()[0][:300]
    return {"fired": guard.fired, "stalled_for": guard.stalled_for, "error": error,
            "waited": time.perf_counter() - t0, "fds": len(fds),
            "spent_process_groups": error is not None}  # the pool starts fresh ranks after it


@scenario("stall-divergent", test_only=True)
def stall_divergent(spec) -> dict:
    """Rank 0 all-reduces 5 elements, rank 1 all-gathers 7: both wait for
    ever (gloo pairs neither)."""
    def body(group):
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(5), group=group)
        else:
            dist.all_gather_into_tensor(torch.empty(14), torch.ones(7), group=group)
    return _guarded(body)


@scenario("stall-slow-rank", test_only=True)
def stall_slow_rank(spec) -> dict:
    """Rank 1 computes for 2.5 s (three times the guard's second) before it
    enters the all-reduce rank 0 waits in: a slow rank, not a hang."""
    def body(group):
        if dist.get_rank() == 1:
            end, x = time.perf_counter() + 2.5, torch.randn(64, 64)
            while time.perf_counter() < end:
                x = torch.tanh(x @ x)
        t = torch.full((3,), float(dist.get_rank() + 1))
        dist.all_reduce(t, group=group)
        assert t.tolist() == [3.0, 3.0, 3.0], t
    return _guarded(body)


@scenario("agree-on-ranks", test_only=True)
def agree_on_ranks(spec) -> dict:
    """What ranks.py's agreement gives where only the last rank failed, and
    where only it saw something else, through the pool's channel."""
    last = dist.get_rank() == dist.get_world_size() - 1
    ch = agree.channel()
    return {"channel": ch is not None, "rounds_before": ch.round if ch else None,
            "any_failed": ranks.any_rank_failed(last), "failed": ranks.failed_ranks(last),
            "none_failed": ranks.any_rank_failed(False), "equal": ranks.all_ranks_equal(("same", 1)),
            "unequal": ranks.all_ranks_equal(("seen", dist.get_rank() if last else 0)),
            "rounds_after": ch.round if ch else None}


@scenario("full-tensors", test_only=True)
def full_tensors_on_ranks(spec) -> dict:
    """fsdp2_adapter.full_tensors against DTensor.full_tensor() on every
    kind of value it is handed: Shard(0) and Shard(1), uneven and
    smaller-than-the-world dims (empty local shards), several dtypes in one
    batch, a Replicate DTensor, a plain tensor and None. Every rank's values
    differ (a shard read from the wrong rank changes the result)."""
    from torch.distributed.device_mesh import init_device_mesh

    from conformance.areas.common.fsdp2_adapter import full_tensors
    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(11)
    shapes = [((5, 3), 0, torch.float32), ((1, 4), 0, torch.float32), ((7,), 0, torch.bfloat16), ((2, 5, 3), 1, torch.float16),
              ((4, 4), 0, torch.float64), ((3, 2), 0, torch.int64), ((6,), 0, torch.bool), ((0, 3), 0, torch.float32)]
    values = {}
    for i, (shape, dim, dtype) in enumerate(shapes):
        full = torch.randn(shape, generator=gen) * 10
        values[f"shard{i}"] = distribute_tensor(full.to(dtype) if dtype != torch.bool else full > 0, mesh, [Shard(dim)])
    values["replicated"] = distribute_tensor(torch.randn((3, 3), generator=gen), mesh, [Replicate()])
    values["plain"] = torch.arange(4.0) + dist.get_rank()
    values["none"] = None
    got = full_tensors(values)
    want = {k: (None if v is None else v.full_tensor() if hasattr(v, "device_mesh") else v) for k, v in values.items()}
    return {"keys": list(got), "same": {k: (got[k] is None and want[k] is None) or
                                        (got[k] is not None and want[k] is not None and got[k].dtype == want[k].dtype
                                         and got[k].shape == want[k].shape and bool(torch.equal(got[k], want[k])))
                                        for k in values},
            "shapes": {k: list(v.shape) for k, v in got.items() if v is not None}}
