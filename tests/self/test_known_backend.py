"""The value-comparing invariants tag their violations with the process
group's backend, so a known failure of one backend's collectives
(fsdp2-gloo-reduce-scatter-avg-sums: torch 2.8.0's gloo reduce_scatter sums
for ReduceOp.AVG) matches there and nowhere else. That the invariants put
the tag on real violations: tests/self/test_faults_fsdp2.py (values in a gloo
pool)."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.case.violation import Violation
from conformance.run import known

pytestmark = pytest.mark.selfcheck

FINDING = "fsdp2-gloo-reduce-scatter-avg-sums"


def _finding() -> known.KnownFailure:
    return next(k for k in known.load() if k.id == FINDING)


def _retag(v: Violation, backend: str) -> Violation:
    tags = {t for t in v.tags if not t.startswith("backend:")} | {f"backend:{backend}"}
    return dataclasses.replace(v, tags=frozenset(tags))


@pytest.mark.parametrize("invariant,tags,matched", [
    ("MP-DTYPES", {"api:fsdp2", "reduce:float32", "kind:grad"}, True),
    ("OPTIM-STATE", {"api:fsdp2", "kind:state-value", "optim:Adam"}, True),
    ("OPTIM-STATE", {"api:fsdp2", "kind:resume-reference", "optim:SGD"}, True),
    ("OPTIM-STATE", {"api:fsdp2", "kind:resume-uninterrupted", "optim:SGD"}, False),
    ("OPTIM-STATE", {"api:fsdp1", "kind:state-value", "optim:Adam"}, False),
    ("MP-DTYPES", {"api:fsdp2", "reduce:bfloat16", "kind:param"}, True),
    ("MP-DTYPES", {"api:fsdp2", "reduce:float16", "kind:grad"}, False),  # SUM then divide: right on 2.8.0
    ("MP-DTYPES", {"api:fsdp1", "reduce:float32", "kind:grad"}, False),
    ("MP-DTYPES", {"api:fsdp2", "reduce:float32", "kind:grad-dtype"}, False),
    ("ACCUM", {"api:fsdp2", "reduce:float32", "kind:grad", "no-sync"}, True),
    ("ACCUM", {"api:fsdp2", "reduce:float32", "kind:reduced-unsynced"}, False),
    ("RANKS-AGREE", {"api:fsdp2", "kind:ranks", "differs:losses_close"}, True),
    ("RANKS-AGREE", {"api:fsdp2", "kind:ranks", "differs:params"}, False),  # a structural disagreement stays a FAIL
    ("PARITY", {"api:fsdp1", "kind:param"}, False),
    ("PARITY", {"api:fsdp2", "kind:raised"}, False),
    ("FSDP2-FROZEN", {"api:fsdp2", "kind:frozen-grad"}, False),
    ("FWD-PARITY", {"api:fsdp2", "kind:output"}, False),
])
def test_the_finding_matches_only_gloo_value_mismatches(invariant, tags, matched):
    k = _finding()
    v = Violation(invariant, "m", frozenset(tags | {"backend:gloo"}))
    assert k.matches_tags(v) is matched
    assert k.matches(v, "2.8.0+cu128") is matched and not k.matches(v, "2.9.1+cu128")  # its repro: 2.8.0 sums, 2.9.1 averages
    assert not k.matches_tags(_retag(v, "nccl"))
    assert not k.matches_tags(Violation(invariant, "m", frozenset(tags)))  # no backend tag (an older baseline): no match


class _Obs:
    """The part of a rank's observation that the rank-agreement check reads."""

    def __init__(self, rank, **fields):
        self.rank, self.api, self.backend, self._fields = rank, "fsdp2", "gloo", fields

    def comparable(self) -> dict:
        return dict(self._fields)


def test_a_rank_disagreement_names_its_fields_and_backend():
    from conformance.areas.common.ranks import ranks_agree

    (v,) = ranks_agree([_Obs(0, losses_close=False, params=1), _Obs(1, losses_close=True, params=1)])
    assert {"kind:ranks", "api:fsdp2", "backend:gloo", "differs:losses_close"} <= v.tags and "differs:params" not in v.tags
    assert _finding().matches_tags(v)
    (v,) = ranks_agree([_Obs(0, losses_close=False, params=1), _Obs(1, losses_close=True, params=2)])
    assert "differs:params" in v.tags  # matched too (the subset rule): the message still names both fields


@pytest.mark.parametrize("mesh,matched", [("mesh:2d", True), ("mesh:tp1", True), ("mesh:dp1", False)])
def test_a_tp_case_matches_only_with_a_data_parallel_dimension(mesh, matched):
    """Gloo's reduce_scatter sums the data-parallel gradients; on a (1, tp)
    mesh FSDP reduces over one rank, so a TP deviation there is something
    else (the release matrix's 2.9.1 / 2.10.0 rows: frozen weights made
    trainable by ColwiseParallel, tp-colwise-rowwise-unfreeze-params)."""
    v = Violation("TP-PARITY", "m", frozenset({"api:fsdp2", "backend:gloo", "kind:param", mesh}))
    assert _finding().matches_tags(v) is matched


def test_matching_at_every_release_prefers_the_finding_whose_range_holds_it(monkeypatch):
    """The release matrix matches every finding at every release; a finding
    in range still takes a violation before an out-of-range one that also
    carries its tags (file order decides only among equals)."""
    gloo = _finding()
    unfreeze = next(k for k in known.load() if k.id == "tp-colwise-rowwise-unfreeze-params")
    v = Violation("TP-PARITY", "m", frozenset({"api:fsdp2", "backend:gloo", "kind:param", "mesh:2d", "style:colwise", "requires-grad:changed"}))
    assert gloo.matches_tags(v) and unfreeze.matches_tags(v)
    both = [gloo, unfreeze]  # the out-of-range one first
    assert known.match(v, both, "2.10.0") is unfreeze
    assert known.match(v, both, "2.13.0") is None
    monkeypatch.setenv(known.ANY_RELEASE_ENV, "1")
    assert known.match(v, both, "2.10.0") is unfreeze
    assert known.match(v, both, "2.8.0") is gloo  # both in range: file order
    assert known.match(v, both, "2.13.0") is gloo  # neither: the first, reported as another release's
