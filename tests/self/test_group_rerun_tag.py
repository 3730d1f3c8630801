"""The tag group:rerun-after-frozen-embedding, which known failure
fsdp2-list-group-reentered-loses-grad matches on, marks exactly the cases
where a list group's module runs again after a frozen Embedding completed
the group's forward: not the same case with the Embedding trainable, nor
without the re-run, nor with the re-run skipped in the microbatch."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.areas.common.fsdp2_oracle import forward_calls
from conformance.areas.schedule.invariants import case_tags
from conformance.areas.schedule.oracle import predict_schedule
from conformance.case.spec import Microbatch, ModuleSpec, ParamSpec
from conformance.run import corpus

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]

TAG = "group:rerun-after-frozen-embedding"


def _case():
    return next(c.spec for c in corpus.load() if c.name == "fsdp2-list-group-reentered-loses-grad")


def _tags(spec) -> set[str]:
    return case_tags(spec, predict_schedule(spec))


def _with_step(spec, **changes):
    step = dataclasses.replace(spec.schedule.steps[0], **changes)
    return dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, steps=(step,)))


def test_the_corpus_case_is_tagged():
    spec = _case()
    # model0 runs, embed1 completes the group [embed1, model0], model0 runs again as shared0
    assert forward_calls(spec) == ["", "model0", "model0.proj1", "embed1", "model0", "model0.proj1"]
    assert TAG in _tags(spec)


def test_a_trainable_embedding_is_not_tagged():
    spec = _case()
    embed = ModuleSpec("embed1", "Embedding", (ParamSpec("weight", (1, 1), True),), (), ())
    tree = dataclasses.replace(spec.tree, children=(spec.tree.children[0], embed))
    spec = _with_step(dataclasses.replace(spec, tree=tree), frozen=("model0.proj1.weight",))
    assert TAG not in _tags(spec)


def test_no_rerun_is_not_tagged():
    spec = dataclasses.replace(_case(), shared=())
    assert TAG not in _tags(spec)


def test_a_microbatch_that_skips_the_embedding_is_not_tagged():
    spec = _with_step(_case(), microbatches=(Microbatch(skip=("embed1",)),))
    assert TAG not in _tags(spec)
