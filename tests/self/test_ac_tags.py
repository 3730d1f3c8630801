"""The activation-checkpointing invariants tag a case that gives fully_shard a
container subclass with a forward, so that
fsdp2-rejects-container-subclass-with-forward explains its wrap-time
ValueError on the releases that have that bug, and only there (release
matrix, 2.8.0 fake-w4: AC-PARITY, AC-STATE-DICT, AC-ALLGATHER)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.activation_checkpointing.invariants import check_allgather, check_parity, check_state_dict
from conformance.areas.activation_checkpointing.observation import ACObservation
from conformance.areas.activation_checkpointing.oracle import predict_ac
from conformance.case.spec import CaseSpec
from conformance.run import known

pytestmark = pytest.mark.selfcheck

# a ModelList(ModuleList) root with a forward, its child checkpointed; FSDP2, the root given to fully_shard
CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "ac-container-subclass-fsdp2.json").read_text())
ERROR = "ValueError: fully_shard does not support containers that do not implement forward: ModelList("
FINDING = next(k for k in known.load() if k.id == "fsdp2-rejects-container-subclass-with-forward")


def _as_plain_module(spec: CaseSpec) -> CaseSpec:
    classes = tuple(dataclasses.replace(c, base="Module") if c.name == "ModelList" else c for c in spec.classes)
    return dataclasses.replace(spec, classes=classes)


def _violations(spec: CaseSpec, error: str):
    obs = ACObservation(api="fsdp2", rank=0, world_size=4, backend="fake", torch_version="2.8.0", wrap_error=error)
    pred = predict_ac(spec)
    return [v for check in (check_parity, check_state_dict, check_allgather) for v in check(spec, pred, obs)]


def test_a_container_subclass_given_to_fully_shard_is_tagged():
    assert CASE.plan.api == "fsdp2"
    assert "container-subclass" in predict_ac(CASE).tags
    assert "container-subclass" not in predict_ac(_as_plain_module(CASE)).tags
    fsdp1 = dataclasses.replace(CASE, plan=dataclasses.replace(CASE.plan, api="fsdp1"))
    assert "container-subclass" not in predict_ac(fsdp1).tags


def test_the_finding_explains_the_wrap_error_only_where_torch_has_the_bug():
    vs = _violations(CASE, ERROR)
    assert {v.invariant for v in vs} == {"AC-PARITY", "AC-STATE-DICT", "AC-ALLGATHER"}
    for v in vs:
        assert FINDING.matches(v, "2.8.0+cu128"), v
        assert not FINDING.matches(v, "2.13.0+cpu"), v
    # the same error on a case without the container: not this finding's
    for v in _violations(_as_plain_module(CASE), ERROR):
        assert not FINDING.matches(v, "2.8.0+cu128"), v
    # another error at wrap time on the container case: not this finding's either
    for v in _violations(CASE, "RuntimeError: something else went wrong"):
        assert not FINDING.matches(v, "2.8.0+cu128"), v


def test_recompute_is_not_judged_against_a_run_whose_units_the_wrapper_changes():
    """A checkpoint_wrapper that FSDP1's size policy may make a unit where
    its ModuleDict could not be one: the run without AC has other units, so
    what the target saved there is no basis for kind:not-recomputed
    (thorough seed 1976322998: without AC modeldict0's frozen weight is a
    view of the root's mixed flat parameter and requires grad; with AC its
    own unit is all frozen and nothing needs recomputing). The forward-count
    checks still run; a target the policy cannot restructure is still held
    to the recompute."""
    from conformance.areas.activation_checkpointing.invariants import check_recompute
    from conformance.areas.activation_checkpointing.oracle import wrappers_that_may_be_units
    from conformance.case.spec import CustomWrap
    from conformance.run import corpus

    spec = next(c.spec for c in corpus.load() if c.name == "suite-ac-recompute-size-policy-wrapper-unit")
    assert wrappers_that_may_be_units(spec) == {"modeldict0"}
    obs = ACObservation(api="fsdp1", rank=0, world_size=2, backend="gloo", torch_version="2.13.0",
                        calls=((0, "modeldict0", 1, 0, 0),), plain_calls=((0, "modeldict0", 1, 0, 1),))
    assert check_recompute(spec, predict_ac(spec), obs) == []
    extra = dataclasses.replace(obs, calls=((0, "modeldict0", 1, 2, 0),))
    assert ["kind:extra-recompute" in v.tags for v in check_recompute(spec, predict_ac(spec), extra)] == [True]
    # the same observation where the units do not change: the policy is not size-based, or no wrapper is used
    for control in (dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, policy=CustomWrap(("modeldict1",)))),
                    dataclasses.replace(spec, activation_checkpoint=dataclasses.replace(spec.activation_checkpoint, kind="utils-checkpoint"))):
        assert not wrappers_that_may_be_units(control)
        assert [v for v in check_recompute(control, predict_ac(control), obs) if "kind:not-recomputed" in v.tags]
