"""The comm area's refreeze under FSDP1 NO_SHARD (use_orig_params=True): a
unit all frozen in the first iteration, its input needing no gradient and its
output one, is left holding plain-tensor views after the first backward
(fsdp1-no-shard-frozen-unit-params-unregistered's mechanism); flipping
requires_grad then reaches the views, and the next backward's final callback
asserts on the hook state. ci seed 26839 read it as a FAIL of COMM-FSDP1-COUNTS
and COMM-FSDP1-PREFETCH; the tag unit:no-shard-frozen-left-unsharded makes it
that finding's form, and FULL_SHARD (which reshards the unit) stays untagged
and passes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.comm.observation import CommObservation
from conformance.areas.comm.oracle import refreeze_tags
from conformance.case.spec import CaseSpec
from conformance.engine.fake import FakeEngine
from conformance.run.runner import KNOWN, PASS, evaluate, observations

pytestmark = pytest.mark.selfcheck

CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "comm-no-shard-frozen-root-refreeze.json").read_text())
FINDING = "fsdp1-no-shard-frozen-unit-params-unregistered"


def _full_shard(spec: CaseSpec) -> CaseSpec:
    return dataclasses.replace(spec, comm=dataclasses.replace(spec.comm, sharding_strategy="FULL_SHARD"))


def test_the_seed_s_case_is_tagged_and_full_shard_is_not():
    assert CASE.comm.sharding_strategy == "NO_SHARD" and CASE.comm.refreeze == ("weight",)
    assert "unit:no-shard-frozen-left-unsharded" in refreeze_tags(CASE)
    assert "unit:no-shard-frozen-left-unsharded" not in refreeze_tags(_full_shard(CASE))
    # a refreeze of another parameter (the trainable one) is not the mechanism
    other = dataclasses.replace(CASE, comm=dataclasses.replace(CASE.comm, refreeze=("lora0.weight",)))
    assert "unit:no-shard-frozen-left-unsharded" not in refreeze_tags(other)


@pytest.mark.fake
def test_the_seed_s_case_is_the_finding_on_the_fake_tier_and_full_shard_passes():
    with FakeEngine(world_size=2) as fake:
        for invariant in ("COMM-FSDP1-COUNTS", "COMM-FSDP1-PREFETCH"):
            res = evaluate(invariant, CASE, observations(fake, CASE, "comm", CommObservation.from_dict))
            assert res.verdict == KNOWN and {fid for _, fid in res.known} == {FINDING}, res.describe()
            full = _full_shard(CASE)
            res = evaluate(invariant, full, observations(fake, full, "comm", CommObservation.from_dict))
            assert res.verdict == PASS, res.describe()
