"""The tag group:multi-self-call-partial, on which fsdp2-forward-method-calls-self
explains a FWD-RESHARD of a *later* call (thorough seed 2297830328): a
registered method that calls self(...) on one module of a list group, whose
other module it does not run. The nested post-forward leaves the group IDLE
with its forward incomplete; the next call's root post-forward completes it
with reshard() outside FORWARD, which shards it whatever
reshard_after_forward says (spec: fully_shard's reshard_after_forward=False
'keeps the unsharded parameters in memory after forward';
register_fsdp_forward_method runs the pre/post-forward hooks around the
method)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.areas.common.fsdp2_oracle import fsdp2_case_tags, predict_fsdp2
from conformance.case.spec import MethodStep, ShardGroup
from conformance.run import corpus

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]

TAG = "group:multi-self-call-partial"
NAME = "fsdp2-forward-method-calls-self-partial-group-later-call"


def _case():
    return next(c.spec for c in corpus.load() if c.name == NAME)


def _tags(spec) -> set[str]:
    return fsdp2_case_tags(spec, predict_fsdp2(spec, torch.__version__))


def test_a_self_call_on_one_module_of_a_list_group_is_tagged():
    assert {TAG, "method-calls-self"} <= _tags(_case())


def test_without_the_self_call_it_is_not_tagged():
    case = _case()
    reads = dataclasses.replace(case.methods[0], steps=(MethodStep(op="param", target="tied0"),))
    assert TAG not in _tags(dataclasses.replace(case, methods=(reads, case.methods[1])))


def test_a_self_call_on_a_module_of_its_own_group_is_not_tagged():
    case = _case()
    own = dataclasses.replace(case.plan, groups=(ShardGroup(modules=("2.layer0",), reshard_after_forward=False),))
    tags = _tags(dataclasses.replace(case, plan=own))
    assert "method-calls-self" in tags and TAG not in tags
