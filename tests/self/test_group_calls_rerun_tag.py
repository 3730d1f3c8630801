"""fsdp2-frozen-list-group-freed-in-backward's reshard_after_forward=False
form (group:multi-frozen-embedding-rerun) needs the group to run twice
before one backward. A module of the group with two names is one way; the
case's calls are another (thorough seed 166287154, torch 2.13.0, fake and
gloo): fully_shard([0, 2], reshard_after_forward=False) on Sequential(Linear,
Linear, Embedding, Linear), the frozen Embedding 2 tied to Linear 0's
weight, and a registered method that reads 1.weight and runs the forward,
called twice; the second call's backward reshards the group and the first
call's Linear 0 finds its weight freed ("setStorage ... storage of size 0").
`fsdp-conformance check`: one call, or the tied weight trainable, passes;
reshard_after_forward=True is the finding's main form."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.areas.common.fsdp2_oracle import fsdp2_case_tags, predict_fsdp2
from conformance.case.violation import Violation
from conformance.run import corpus, known

pytestmark = pytest.mark.selfcheck

TAG = "group:multi-frozen-embedding-rerun"
FINDING = "fsdp2-frozen-list-group-freed-in-backward"
ERROR = ("backward raised RuntimeError: setStorage: sizes [1, 1], strides [1, 1], storage offset 0, and itemsize 4 requiring a "
         "storage size of 4 are out of bounds for storage of size 0")


def _case():
    return next(c.spec for c in corpus.load() if c.name == "fsdp2-frozen-list-group-freed-in-backward-calls-rerun")


def _tags(spec) -> set[str]:
    return fsdp2_case_tags(spec, predict_fsdp2(spec, "2.13.0"))


def _times(spec, n: int):
    return dataclasses.replace(spec, calls=(dataclasses.replace(spec.calls[0], times=n),))


def test_two_calls_before_the_backward_run_the_group_twice():
    spec = _case()
    assert [c.times for c in spec.calls] == [2] and spec.plan.groups[0].reshard_after_forward is False
    assert predict_fsdp2(spec, "2.13.0").group_passes[0] == 2  # the list group; the root is a group of its own
    assert TAG in _tags(spec)


def test_one_call_or_a_trainable_tied_weight_is_not_tagged():
    assert predict_fsdp2(_times(_case(), 1), "2.13.0").group_passes[0] == 1
    assert TAG not in _tags(_times(_case(), 1))
    spec = _case()
    thawed = tuple(dataclasses.replace(c, params=tuple(dataclasses.replace(p, requires_grad=True) for p in c.params))
                   if c.name in ("0", "2") else c for c in spec.tree.children)
    assert TAG not in _tags(dataclasses.replace(spec, tree=dataclasses.replace(spec.tree, children=thawed)))


def test_the_finding_explains_the_freed_weight_only_with_the_second_call():
    found = known.load()
    extra = {"kind:backward-raised", "raised:RuntimeError", "error:freed-storage", "backend:gloo"}
    for inv in ("FSDP2-FROZEN", "FWD-PARITY"):
        got = known.match(Violation(inv, f"[{inv}] {ERROR}", frozenset(_tags(_case()) | extra)), found, "2.13.0")
        assert got is not None and got.id == FINDING, inv
        assert known.match(Violation(inv, f"[{inv}] {ERROR}", frozenset(_tags(_times(_case(), 1)) | extra)), found, "2.13.0") is None
