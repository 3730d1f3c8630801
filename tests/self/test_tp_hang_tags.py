"""A HANG or CRASH of the tp scenario carries shard:strided-uneven where the
case has a _StridedShard parameter whose TP-local rows split unevenly over dp,
so that fsdp2-tp-uneven-strided-full-state-dict-load-misplaces-rows explains
the hang its one-rank raise leaves behind on the releases that have it, and
only there (release matrix, 2.8.0 and 2.9.1 gloo-w2: every TP invariant HANG)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.tp.invariants import failure_tags
from conformance.areas.tp.oracle import predict_tp
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation
from conformance.run import known

pytestmark = pytest.mark.selfcheck

# ColwiseParallel on model0.layers0.0, a Linear with a (2, 2) weight: one TP-local row per tp rank, 1 / 0 over dp
CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "tp-strided-uneven-hang.json").read_text())
FINDING = next(k for k in known.load() if k.id == "fsdp2-tp-uneven-strided-full-state-dict-load-misplaces-rows")
TP = ("TP-LAYOUT", "TP-FULL-TENSOR", "TP-PARITY", "TP-STATE-DICT", "TP-MP-DTYPE", "TP-CLIP")


def _even(spec: CaseSpec) -> CaseSpec:
    """The same model with a (4, 2) weight: two TP-local rows per tp rank, 1 / 1 over dp."""
    model0 = spec.tree.children[0]
    layers0 = model0.children[0]
    (linear,) = layers0.children
    linear = dataclasses.replace(linear, params=(dataclasses.replace(linear.params[0], shape=(4, 2)),))
    model0 = dataclasses.replace(model0, children=(dataclasses.replace(layers0, children=(linear,)), *model0.children[1:]))
    return dataclasses.replace(spec, tree=dataclasses.replace(spec.tree, children=(model0,)))


def _hang(spec: CaseSpec, invariant: str) -> Violation:
    # as the session records a HANG: the scenario's failure tags and the verdict
    return Violation(invariant, "HANG: scenario 'tp' on 4 gloo ranks, no result within 15.0s", frozenset(failure_tags(spec, predict_tp(spec)) | {"kind:hang"}))


def test_a_hang_of_an_uneven_strided_case_is_tagged():
    assert "shard:strided-uneven" in failure_tags(CASE, predict_tp(CASE))
    assert "shard:strided-uneven" not in failure_tags(_even(CASE), predict_tp(_even(CASE)))


def test_the_finding_explains_the_hang_only_where_torch_has_the_bug():
    for inv in TP:
        v = _hang(CASE, inv)
        assert FINDING.matches(v, "2.8.0+cu128") and FINDING.matches(v, "2.9.1+cu128"), inv
        assert not FINDING.matches(v, "2.10.0+cu128") and not FINDING.matches(v, "2.13.0+cpu"), inv
        assert not FINDING.matches(_hang(_even(CASE), inv), "2.8.0+cu128"), inv
