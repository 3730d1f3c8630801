"""The StallGuard (conformance.areas.common.stall) on real gloo ranks: a
collective no other rank will match is closed within seconds, not at the
group's timeout; a rank that is slow on CPU is waited for. Spec: the
INIT-DIVERGENT statement (a hang is a violation; every rank blocked on the
example's group is one)."""

import pytest

import tests.self.rank_scenarios as sc
from conformance.case.examples import lora_model

pytestmark = pytest.mark.gloo


def test_ranks_blocked_in_unmatched_collectives_are_closed_by_the_guard(fault_pools):
    records = fault_pools(2).run("stall-divergent", lora_model(num_layers=1, seed=1))
    assert all(r["ok"] for r in records), records
    for r in records:
        v = r["value"]
        assert v["fds"] > 0, v  # the group's sockets were found
        # the collective raised because the group was closed (a peer gone),
        # long before its 30 s timeout
        assert v["error"] and "Connection closed by peer" in v["error"] and "Timed out" not in v["error"], v
        assert v["waited"] < sc.GROUP_TIMEOUT / 2, v
    assert any(r["value"]["fired"] and r["value"]["stalled_for"] >= 1.0 for r in records), records


def test_a_rank_busy_before_the_collective_is_not_a_hang(fault_pools):
    records = fault_pools(2).run("stall-slow-rank", lora_model(num_layers=1, seed=2))
    assert all(r["ok"] for r in records), records
    for r in records:
        v = r["value"]
        assert v["fds"] > 0 and not v["fired"] and v["error"] is None, v
    # rank 0 waited in the collective for rank 1's 2.5 s, past the guard's second
    assert records[0]["value"]["waited"] >= 2.5, records
