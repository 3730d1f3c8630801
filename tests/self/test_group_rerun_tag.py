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


def test_the_checkpoint_cases_backward_in_the_fully_shard_area_is_the_finding(fake_engine):
    """Thorough seed 3683's checkpoint case (tests/self/data, the save's
    training raised there) through the fully_shard area: its backward raises
    "setStorage ... storage of size 0" under the finding's tag; with the
    root's shared name gone (model0 runs once, no re-run after the Embedding
    completed the group) it trains. Another backward error with the same tags
    stays a FAIL."""
    from pathlib import Path

    from conformance.case.model_case import case_from_json
    from conformance.run import known
    from conformance.run.runner import check_example, evaluate, observations

    spec = case_from_json((Path(__file__).parent / "data" / "ckpt-group-rerun-after-frozen-embedding.json").read_text())
    [res] = check_example(["FSDP2-FROZEN"], spec, fake_engine, known.load())
    assert res.verdict == "KNOWN" and {fid for _, fid in res.known} == {"fsdp2-list-group-reentered-loses-grad"}, res.describe()
    assert TAG in res.known[0][0].tags
    once = dataclasses.replace(spec, shared=tuple(s for s in spec.shared if s.parent != ""))
    [res] = check_example(["FSDP2-FROZEN"], once, fake_engine, known.load())
    assert res.verdict == "PASS", res.describe()
    obs = [dataclasses.replace(o, backward_error="RuntimeError: something else") for o in observations(fake_engine, spec, "fsdp2")]
    assert evaluate("FSDP2-FROZEN", spec, obs, known.load()).verdict == "FAIL"
