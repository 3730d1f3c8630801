"""The clipping invariants tag a case that gives fully_shard a container
subclass with a forward, so that fsdp2-rejects-container-subclass-with-forward
explains its wrap-time ValueError on the releases that have that bug, and
only there (release matrix, 2.8.0 gloo-w2: CLIP-NORM, CLIP-GRADS)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.clip.invariants import check_grads, check_norm
from conformance.areas.clip.observation import ClipObservation
from conformance.areas.clip.oracle import predict_clip
from conformance.case.spec import CaseSpec
from conformance.run import known

pytestmark = pytest.mark.selfcheck

# a ModelDict(ModuleDict) root with a forward, given to fully_shard (no groups)
CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "clip-container-subclass-fsdp2.json").read_text())
ERROR = "ValueError: fully_shard does not support containers that do not implement forward: ModelDict("
FINDING = next(k for k in known.load() if k.id == "fsdp2-rejects-container-subclass-with-forward")


def _as_plain_module(spec: CaseSpec) -> CaseSpec:
    classes = tuple(dataclasses.replace(c, base="Module") if c.name == "ModelDict" else c for c in spec.classes)
    return dataclasses.replace(spec, classes=classes)


def _violations(spec: CaseSpec, error: str):
    obs = [ClipObservation(api="fsdp2", rank=r, world_size=2, backend="gloo", torch_version="2.8.0", wrap_error=error) for r in range(2)]
    pred = predict_clip(spec)
    return check_norm(spec, pred, obs) + check_grads(spec, pred, obs[0])


def test_a_container_subclass_given_to_fully_shard_is_tagged():
    assert CASE.plan.api == "fsdp2"
    assert "container-subclass" in predict_clip(CASE).tags
    assert "container-subclass" not in predict_clip(_as_plain_module(CASE)).tags


def test_the_finding_explains_the_wrap_error_only_where_torch_has_the_bug():
    vs = _violations(CASE, ERROR)
    assert {v.invariant for v in vs} == {"CLIP-NORM", "CLIP-GRADS"}
    for v in vs:
        assert FINDING.matches(v, "2.8.0+cu128"), v
        assert not FINDING.matches(v, "2.13.0+cpu"), v
    for v in _violations(_as_plain_module(CASE), ERROR):
        assert not FINDING.matches(v, "2.8.0+cu128"), v
    for v in _violations(CASE, "RuntimeError: something else went wrong"):
        assert not FINDING.matches(v, "2.8.0+cu128"), v


def test_a_backward_over_freed_storage_is_tagged():
    """The clipping area's training step raising over a freed parameter (seed
    22, torch 2.13.0: fsdp2-frozen-list-group-freed-in-backward's group) is
    tagged with that mechanism; another RuntimeError is not."""
    from conformance.areas.clip.invariants import error_tag

    freed = ("RuntimeError: setStorage: sizes [1, 3], strides [3, 1], storage offset 0, and itemsize 4 requiring a "
             "storage size of 12 are out of bounds for storage of size 0")
    assert error_tag(freed) == "error:freed-storage"
    assert error_tag("RuntimeError: setStorage: out of bounds for storage of size 12") == "error:other"


@pytest.mark.needs_ranks  # the clipping area compares the ranks' values
def test_the_freed_parameter_met_as_unallocated_data_is_the_finding_where_its_mechanism_is(worlds):
    """Thorough seed 115 (torch 2.13.0, gloo): the clipping area's training on
    fully_shard([2, 1]), the frozen Embedding 2 completing the group while
    Block 1 holds its weight (tied0) beside frozen Linears, raised "... its
    data is not allocated yet": the finding's backward meeting the freed
    parameter in another op, FAIL before (error:other). KNOWN now; the
    same case with reshard_after_forward=False trains and passes."""
    from conformance.areas.clip.invariants import error_tag
    from conformance.run.runner import check_example

    assert error_tag("RuntimeError: The tensor has a non-zero number of elements, but its data is not allocated yet.") == "error:data-not-allocated"
    case = CaseSpec.from_json((Path(__file__).parent / "data" / "clip-frozen-list-group-data-not-allocated.json").read_text())
    engine = worlds.engine(2)
    for r in check_example(["CLIP-NORM", "CLIP-GRADS"], case, engine):
        assert r.verdict == "KNOWN" and {fid for _, fid in r.known} == {"fsdp2-frozen-list-group-freed-in-backward"}, r.describe()
    (group,) = case.plan.groups
    kept = dataclasses.replace(case, plan=dataclasses.replace(case.plan, groups=(dataclasses.replace(group, reshard_after_forward=False),)))
    for r in check_example(["CLIP-NORM", "CLIP-GRADS"], kept, engine):
        assert r.verdict == "PASS", r.describe()
