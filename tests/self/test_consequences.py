"""Consequences are findings: where FSDP must reject a case (a rule of its
own) but accepts it, the training invariants do not stop at "not promised":
they record what training then does, tagged outside:<rule>, so that the
finding that FSDP accepted the case matches it (KNOWN) and any other outcome
stays visible; a case FSDP rejects as it must, or one whose rule is not of
that kind, is not checked (with its reason)."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.areas.common.catalog import NotChecked
from conformance.areas.common.training_oracle import predict_training
from conformance.areas.parity.invariants import check_training
from conformance.areas.parity.observation import TrainObservation
from conformance.case.examples import lora_model
from conformance.case.spec import TrainPlan

pytestmark = pytest.mark.selfcheck

SPEC = dataclasses.replace(lora_model(num_layers=1), train=TrainPlan(), plan=dataclasses.replace(lora_model(num_layers=1).plan, use_orig_params=True))
# the case's real prediction, told that it breaks the tie rule
BELOW_LCA = dataclasses.replace(predict_training(SPEC), applicable="a tied parameter's unit is below its users' common ancestor (rejected, TIES)",
                                frozen=(), rule="tie-below-lca")
OBS = TrainObservation(api="fsdp1", rank=0, world_size=2, backend="gloo", torch_version="2.13.0", losses=(1.0, 0.5), ref_losses=(1.0, 0.5),
                       losses_close=True)


def _check(pred, obs):
    return check_training(SPEC, pred, obs)


def test_a_crash_outside_the_promise_is_recorded_with_its_rule_and_exception():
    (v,) = _check(BELOW_LCA, dataclasses.replace(OBS, step_error="RuntimeError: 'weight' must be 2-D"))
    assert {"outside-promise", "outside:tie-below-lca", "kind:raised", "raised:RuntimeError"} <= v.tags
    assert "FSDP accepted it" in v.message


def test_wrong_values_outside_the_promise_are_recorded():
    obs = dataclasses.replace(OBS, losses=(1.0, 0.9), losses_close=False)
    (v,) = _check(BELOW_LCA, obs)
    assert {"outside:tie-below-lca", "kind:loss"} <= v.tags


def test_a_case_fsdp_rejected_or_trained_right_is_not_checked():
    assert isinstance(_check(BELOW_LCA, dataclasses.replace(OBS, wrap_error="ValueError: tie below LCA")), NotChecked)
    assert isinstance(_check(BELOW_LCA, OBS), NotChecked)  # accepted and trained as the reference: nothing to record
    mixed = dataclasses.replace(BELOW_LCA, applicable="FSDP1 rejects mixed requires_grad with use_orig_params=False", rule="frozen-mixed")
    assert isinstance(_check(mixed, dataclasses.replace(OBS, step_error="RuntimeError: x")), NotChecked)  # FROZEN-ERROR's case
