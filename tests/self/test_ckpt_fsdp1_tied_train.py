"""fsdp1-no-shard-frozen-unit-params-unregistered, its tied form in the
checkpoint area's training before the save (thorough seed 117, torch 2.13.0,
gloo): use_orig_params=True on one rank (FULL_SHARD runs as NO_SHARD), frozen
Block scales 0.0.scale and 0.1.scale tied, trainable Linears their own units;
the training asserts "as_params=True type(prim_param)=<class
'torch.Tensor'>". Checked with `fsdp-conformance check` on 2 gloo ranks:
without the tie the same case raises in the save instead (the finding's
phase:save form)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.checkpoint.observation import CkptObservation
from conformance.case.spec import CaseSpec
from conformance.run.runner import evaluate

pytestmark = pytest.mark.selfcheck

CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "ckpt-fsdp1-one-rank-tied-frozen-train.json").read_text())
ASSERTED = "AssertionError: as_params=True type(prim_param)=<class 'torch.Tensor'>"


def _ckpt(spec: CaseSpec, invariant: str, error: str = ASSERTED):
    obs = [CkptObservation(kind="roundtrip", api="fsdp1", rank=0, world_size=1, backend="gloo", torch_version="2.13.0",
                           error=error, phase="train")]
    return evaluate(invariant, spec, obs)


@pytest.mark.parametrize("invariant", ["CKPT-RESHARD", "OPTIM-STATE"])
def test_the_tied_form_in_the_training_before_the_save_is_that_finding(invariant):
    res = _ckpt(CASE, invariant)
    assert res.verdict == "KNOWN" and {fid for _, fid in res.known} == {"fsdp1-no-shard-frozen-unit-params-unregistered"}, res.describe()
    other = _ckpt(CASE, invariant, "AssertionError: something else")  # not the shared parameter's assert
    assert other.verdict == "FAIL", other.describe()
    untied = _ckpt(dataclasses.replace(CASE, ties=()), invariant)  # no tie: not this form's mechanism
    assert untied.verdict == "FAIL", untied.describe()
