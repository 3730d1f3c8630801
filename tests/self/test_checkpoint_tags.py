"""The checkpoint invariants tag a case whose FSDP2 side (save or load) gives
fully_shard a container subclass with a forward, so that
fsdp2-rejects-container-subclass-with-forward explains its ValueError on the
releases that have that bug, and only there (release matrix, 2.10.0 gloo-w2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.checkpoint.invariants import case_tags
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation
from conformance.run import known

pytestmark = pytest.mark.selfcheck

# saved under FSDP1, loaded under FSDP2 (no groups: the ModelDict root is given to fully_shard)
CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "ckpt-container-subclass-fsdp2-load.json").read_text())


def _as_plain_module(spec: CaseSpec) -> CaseSpec:
    classes = tuple(dataclasses.replace(c, base="Module") if c.name == "ModelDict" else c for c in spec.classes)
    return dataclasses.replace(spec, classes=classes)


def test_the_fsdp2_load_side_of_a_container_subclass_is_tagged():
    assert CASE.plan.api == "fsdp1" and CASE.ckpt.load_plan.api == "fsdp2"
    assert "container-subclass" in case_tags(CASE)
    assert "container-subclass" not in case_tags(_as_plain_module(CASE))
    fsdp1_only = dataclasses.replace(CASE, ckpt=dataclasses.replace(CASE.ckpt, load_plan=CASE.plan))
    assert "container-subclass" not in case_tags(fsdp1_only)


def test_the_finding_explains_the_wrap_error_only_where_torch_has_the_bug():
    v = Violation("OPTIM-STATE", "rank 0: wrap raised ValueError: fully_shard does not support containers that do not implement forward",
                  frozenset(case_tags(CASE) | {"kind:raised", "error:ValueError", "phase:wrap"}))
    finding = next(k for k in known.load() if k.id == "fsdp2-rejects-container-subclass-with-forward")
    assert finding.matches(v, "2.10.0+cu128")
    assert not finding.matches(v, "2.13.0+cpu")
    plain = Violation(v.invariant, v.message, frozenset(case_tags(_as_plain_module(CASE)) | {"kind:raised", "error:ValueError"}))
    assert not finding.matches(plain, "2.10.0+cu128")


def test_a_group_that_keeps_its_parameters_unsharded_after_forward_is_tagged():
    """Not only the root (reshard_after_forward None is False for it): a
    group given False keeps its unsharded parameters registered after
    forward too, and set_model_state_dict after a forward copies into them
    (seed 40 of the ci profile, torch 2.13.0: TIES-KEPT, a non-root group's
    2.weight); with None there the case loads."""
    spec = CaseSpec.from_json((Path(__file__).parent / "data" / "ckpt-warm-load-group-no-reshard.json").read_text())
    assert spec.ckpt.warm and spec.plan.groups[1].reshard_after_forward is False
    assert "group-unsharded-after-forward" in case_tags(spec)
    groups = (spec.plan.groups[0], dataclasses.replace(spec.plan.groups[1], reshard_after_forward=None))
    resharding = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, groups=groups))
    assert "group-unsharded-after-forward" not in case_tags(resharding)  # the root manages nothing here
    error = ("rank 0: load raised RuntimeError: Error(s) in loading state_dict for FSDPModelSeq: 2.weight: aten.copy_.default "
             "got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor before calling distributed operators!")
    finding = next(k for k in known.load() if k.id == "fsdp2-set-model-state-dict-after-forward-raises")
    extra = {"kind:raised", "phase:load", "error:RuntimeError", "cause:copy-into-unsharded"}
    assert finding.matches(Violation("TIES-KEPT", error, frozenset(case_tags(spec) | extra)), "2.13.0")
    assert not finding.matches(Violation("TIES-KEPT", error, frozenset(case_tags(resharding) | extra)), "2.13.0")


def test_a_list_group_completed_by_an_embedding_refrozen_before_the_save_is_the_save_s_own_training():
    """The save's steps after the first run under the mask its refreeze
    leaves: an FSDP2 list group whose Embedding that mask freezes is
    fsdp2-frozen-list-group-freed-in-backward's in the training phase (ci
    seed 9177: "train raised RuntimeError: setStorage ... storage of size 0"
    at step 1); without the refreeze, with one step, or with the group kept
    unsharded after forward, the save's training runs (checked on 2 gloo
    ranks) and the tag is not there."""
    from conformance.areas.checkpoint.oracle import predict_ckpt
    from conformance.run import corpus

    def case_tags_(spec):
        return case_tags(spec, predict_ckpt(spec))

    spec = next(c.spec for c in corpus.load() if c.name == "fsdp2-frozen-list-group-freed-in-backward-ckpt-refreeze")
    assert "group:multi-frozen-embedding" in case_tags_(spec)
    ck = spec.ckpt
    kept = dataclasses.replace(spec.plan.groups[0], reshard_after_forward=False)
    for control in (dataclasses.replace(spec, ckpt=dataclasses.replace(ck, refreeze=())),
                    dataclasses.replace(spec, ckpt=dataclasses.replace(ck, steps=1)),
                    dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, groups=(kept,)))):
        assert "group:multi-frozen-embedding" not in case_tags_(control)
    v = Violation("CKPT-RESHARD", "rank 0: train raised RuntimeError: setStorage: sizes [1, 1], strides [1, 1], storage offset 0, "
                  "and itemsize 4 requiring a storage size of 4 are out of bounds for storage of size 0",
                  frozenset(case_tags_(spec) | {"kind:raised", "phase:train", "error:RuntimeError", "cause:freed-storage"}))
    finding = next(k for k in known.load() if k.id == "fsdp2-frozen-list-group-freed-in-backward")
    assert finding.matches(v, "2.13.0+cpu")


def test_the_mask_a_checkpoint_is_loaded_into_is_tagged_and_explains_the_resume_assertion():
    """load-frozen: the model loaded and trained on freezes some parameter.
    fsdp1-no-shard-frozen-unit-params-unregistered's resume form hangs on it,
    not on the save's mask: its corpus case saves every parameter trainable
    and freezes the tied root weight at the load (selfcheck's 60-example FSDP1
    round trip, torch 2.13.0: a FAIL while the match asked for "frozen")."""
    from conformance.areas.checkpoint.oracle import predict_ckpt
    from conformance.run import corpus

    case = next(c for c in corpus.load() if c.name == "fsdp1-no-shard-frozen-unit-params-unregistered-frozen-at-load")
    tags = case_tags(case.spec, predict_ckpt(case.spec))
    assert "load-frozen" in tags and "frozen" not in tags
    thawed_spec = dataclasses.replace(case.spec, ckpt=dataclasses.replace(case.spec.ckpt, load_frozen=()))
    assert "load-frozen" not in case_tags(thawed_spec, predict_ckpt(thawed_spec))
    # what the failure adds: where it raised, and the error's cause (the shared parameter a plain Tensor)
    raised = {"kind:raised", "error:AssertionError", "raised:AssertionError", "phase:resume", "rank:0", "cause:shared-param-not-parameter"}
    v = Violation("OPTIM-STATE", "rank 0: resume raised AssertionError: as_params=True type(prim_param)=<class 'torch.Tensor'>",
                  frozenset(tags | raised))
    finding = next(k for k in known.load() if k.id == case.finding)
    assert known.match(v, [finding], "2.13.0") is finding
    thawed = frozenset((tags - {"load-frozen"}) | raised)  # the same failure with nothing frozen at the load: not this finding
    assert known.match(Violation("OPTIM-STATE", v.message, thawed), [finding], "2.13.0") is None
