"""INIT-DIVERGENT (fully_shard / FullyShardedDataParallel docstrings: the
gradients of the per-rank forwards, or a clear error on every rank; never a
hang): a module with a fully_shard group of its own that rank 1's forward
passes over. Where rank 1's next all-gather on the group has the size of the
one it skipped, the two pair silently and each rank computes with the other
group's shards (ci seed 81, torch 2.13.0: every parameter frozen, the root's
group resharding after forward, the skipped group not; the losses and final
values differ from single-process, no error, no timeout). That is
fsdp2-rank-divergent-module-collective-mismatch, its mechanism the own group's
collective one rank never issues; the same values where rank 1 skips no
module of a group of its own are a failure."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from conformance.areas.init_order.observation import InitObservation
from conformance.case.spec import CaseSpec
from conformance.run.runner import FAIL, KNOWN, evaluate

pytestmark = pytest.mark.selfcheck

DATA = json.loads((Path(__file__).parent / "data" / "init-divergent-own-group-pairs-silently.json").read_text())
CASE = CaseSpec.from_json(json.dumps(DATA["case"]))
FINDING = "fsdp2-rank-divergent-module-collective-mismatch"


def _observations():
    return [InitObservation.from_dict({**o, "torch_version": "2.13.0+cpu"}) for o in DATA["observations"]]


def test_the_silent_pairing_is_the_own_group_finding():
    assert CASE.init.skip == "proj0" and [g.modules for g in CASE.plan.groups] == [("proj0",), ("",)]
    res = evaluate("INIT-DIVERGENT", CASE, _observations())
    assert res.verdict == KNOWN and {fid for _, fid in res.known} == {FINDING}, res.describe()
    # the ranks' different final values too (RANKS-AGREE, tagged with the skip's form)
    assert any(v.invariant == "RANKS-AGREE" and "skip:own-group" in v.tags for v, _ in res.known), res.describe()


def test_the_same_values_without_an_own_group_are_a_failure():
    one_group = dataclasses.replace(CASE, plan=dataclasses.replace(CASE.plan, groups=(CASE.plan.groups[1],)))
    res = evaluate("INIT-DIVERGENT", one_group, _observations())
    assert res.verdict == FAIL, res.describe()


@pytest.mark.gloo
def test_a_divergent_example_after_one_on_the_default_mesh_does_not_hang(fault_pools):
    """DTensor's sharding-propagation cache keys on DeviceMesh equality, which
    ignores process groups: after an FSDP2 example on the default group's
    mesh, the divergent example's mesh (a group of its own, 8 s timeout) hit
    the old entries and full_tensor() went to the default group, where the
    missed all-gather waited for the pool's deadline (`fsdp-conformance
    check` on the seed 81 case: HANG after 60 s; alone: 6 s). The adapter
    now clears those caches before sharding on the example's own mesh."""
    pool = fault_pools(2)
    assert all(r["ok"] for r in pool.run("fsdp2", CASE))
    t0 = time.monotonic()
    rebuilds = pool.rebuilds
    records = pool.run("init_order", CASE, deadline=30.0)
    assert time.monotonic() - t0 < 30.0
    assert all(r["ok"] and not r["value"]["timed_out"] for r in records), records
    # no hang, yet the example's own group dies with its ranks, never torn
    # down in a live one (conformance.areas.init_order.adapter.observe)
    assert all(r["value"]["spent_process_groups"] for r in records) and pool.rebuilds == rebuilds + 1


# FSDP1's form (thorough seed 94): rank 1 skips 1.seq1.0, a unit given
# SHARD_GRAD_OP by CustomPolicy's kwargs, every parameter frozen. No backward
# all-gather runs, so rank 1's next all-gather of the same size pairs with the
# one it skipped: no timeout, the ranks' final values differ from each other
# and from single-process training (fsdp1-rank-divergent-unit-hangs' silent
# form; with FULL_SHARD the same case hangs, its recorded form). Observations
# from one gloo run of the case.
DATA1 = json.loads((Path(__file__).parent / "data" / "init-divergent-fsdp1-unit-pairs-silently.json").read_text())
CASE1 = CaseSpec.from_json(json.dumps(DATA1["case"]))


def test_fsdp1_s_silent_pairing_is_its_rank_divergent_finding():
    obs = [InitObservation.from_dict({**o, "torch_version": "2.13.0+cpu"}) for o in DATA1["observations"]]
    assert CASE1.init.skip == "1.seq1.0" and not any(o.timed_out for o in obs)
    res = evaluate("INIT-DIVERGENT", CASE1, obs)
    assert res.verdict == KNOWN and {fid for _, fid in res.known} == {"fsdp1-rank-divergent-unit-hangs"}, res.describe()
    assert {v.invariant for v, _ in res.known} == {"INIT-DIVERGENT", "RANKS-AGREE"}, res.describe()
    # the losses off too (the area's re-run of seed 94: rank 0's 0.060 against 0.578)
    off = [dataclasses.replace(o, losses_close=False) if o.rank == 0 else o for o in obs]
    res = evaluate("INIT-DIVERGENT", CASE1, off)
    assert res.verdict == KNOWN and any("kind:loss" in v.tags for v, _ in res.known), res.describe()
    # the skipped module not a unit of its own: the same values are a failure
    policy = dataclasses.replace(CASE1.plan.policy, targets=("0",), kwargs=())
    not_own = dataclasses.replace(CASE1, plan=dataclasses.replace(CASE1.plan, policy=policy))
    assert evaluate("INIT-DIVERGENT", not_own, obs).verdict == FAIL
