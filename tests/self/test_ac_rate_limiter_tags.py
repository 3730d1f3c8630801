"""fsdp1-selective-ac-rate-limiter-op-mismatch beyond a frozen unit: thorough
seed 66 (torch 2.13.0, gloo) raised its error with selective AC around two
trainable FSDP1 Embedding units, and trained with limit_all_gathers=False
forced in FSDP's constructor (checked under torchrun 2): the rate limiter's
record_function is counted differently in the forward and the recompute,
the finding's mechanism. Its rules take any unit in the region; the same
error without a unit in the region, or outside selective AC, is not it."""

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

CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "ac-selective-trainable-units-rate-limiter.json").read_text())
ERROR = ("RuntimeError: profiler._record_function_enter_new.default invocation index 10 encountered during backward "
         "but not found in storage. This can happen if the operations in the checkpointed region are nondeterministic")
FINDING = next(k for k in known.load() if k.id == "fsdp1-selective-ac-rate-limiter-op-mismatch")


def _violations(spec: CaseSpec):
    obs = ACObservation(api="fsdp1", rank=0, world_size=2, backend="gloo", torch_version="2.13.0", step_error=ERROR)
    pred = predict_ac(spec)
    return [v for check in (check_parity, check_state_dict, check_allgather) for v in check(spec, pred, obs)]


def test_trainable_units_in_a_selective_region_are_the_findings():
    tags = predict_ac(CASE).tags
    assert {"ac:selective", "ac:unit-in-region"} <= tags and "ac:frozen-unit-in-region" not in tags
    vs = _violations(CASE)
    assert {v.invariant for v in vs} == {"AC-PARITY", "AC-STATE-DICT", "AC-ALLGATHER"}
    assert all(FINDING.matches(v, "2.13.0+cpu") for v in vs), vs
    assert not any(FINDING.matches(v, "2.12.1") for v in vs)  # before 2.13's SAC check


def test_the_same_error_without_a_unit_in_the_region_or_selective_ac_is_not():
    no_units = dataclasses.replace(CASE, plan=dataclasses.replace(CASE.plan, policy=None))
    assert "ac:unit-in-region" not in predict_ac(no_units).tags
    assert not any(FINDING.matches(v, "2.13.0+cpu") for v in _violations(no_units))
    plain = dataclasses.replace(CASE, activation_checkpoint=dataclasses.replace(CASE.activation_checkpoint, kind="utils-checkpoint"))
    assert not any(FINDING.matches(v, "2.13.0+cpu") for v in _violations(plain))
