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
