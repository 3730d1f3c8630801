"""A HANG or CRASH of the tp scenario carries shard:strided-empty where the
case has a _StridedShard parameter with fewer TP-local rows than dp (a rank's
piece is empty), so that
fsdp2-tp-uneven-strided-full-state-dict-load-misplaces-rows explains the hang
its one-rank raise leaves behind on the releases that have it, and only there
(release matrix, 2.8.0 gloo-w2: every TP invariant HANG). An uneven split
without an empty piece loads without raising: its hang is not this one's."""

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


def _rows(spec: CaseSpec, rows: int) -> CaseSpec:
    """The same model with a (rows, 2) weight."""
    model0 = spec.tree.children[0]
    layers0 = model0.children[0]
    (linear,) = layers0.children
    linear = dataclasses.replace(linear, params=(dataclasses.replace(linear.params[0], shape=(rows, 2)),))
    model0 = dataclasses.replace(model0, children=(dataclasses.replace(layers0, children=(linear,)), *model0.children[1:]))
    return dataclasses.replace(spec, tree=dataclasses.replace(spec.tree, children=(model0,)))


def _hang(spec: CaseSpec, invariant: str) -> Violation:
    # as the session records a HANG: the scenario's failure tags and the verdict
    return Violation(invariant, "HANG: scenario 'tp' on 4 gloo ranks, no result within 15.0s", frozenset(failure_tags(spec, predict_tp(spec), 4) | {"kind:hang"}))


def _tags(spec: CaseSpec) -> set[str]:
    return failure_tags(spec, predict_tp(spec), 4)


def test_a_hang_of_a_strided_case_with_an_empty_piece_is_tagged():
    assert {"shard:strided-uneven", "shard:strided-empty"} <= _tags(CASE)
    assert not {"shard:strided-uneven", "shard:strided-empty"} & _tags(_rows(CASE, 4))  # 2 / 2 rows, 1 / 1 over dp
    assert "shard:strided-uneven" in _tags(_rows(CASE, 7)) and "shard:strided-empty" not in _tags(_rows(CASE, 7))  # 4 / 3 rows


def test_the_finding_explains_the_hang_only_where_torch_has_the_bug():
    for inv in TP:
        v = _hang(CASE, inv)
        assert FINDING.matches(v, "2.8.0+cu128") and FINDING.matches(v, "2.9.1+cu128"), inv
        assert not FINDING.matches(v, "2.10.0+cu128") and not FINDING.matches(v, "2.13.0+cpu"), inv
        assert not FINDING.matches(_hang(_rows(CASE, 4), inv), "2.8.0+cu128"), inv
        assert not FINDING.matches(_hang(_rows(CASE, 7), inv), "2.9.1+cu128"), inv
