"""FROZEN-ERROR's tag mix:shared-parent, on which
fsdp1-callable-policy-wraps-shared-module-twice explains a missing ValueError
(ci seed 30144): the unit predicted to mix requires_grad holds a parameter of
the module that registers a shared module under its second name, which a
size policy may make a unit of its own (spec: FSDP1 with
use_orig_params=False requires uniform requires_grad per unit; the finding's
summary)."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.areas.autowrap.invariants import _shared_parent_mix
from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.run import corpus

pytestmark = pytest.mark.selfcheck

NAME = "fsdp1-callable-policy-wraps-shared-module-twice-no-frozen-error"


def _case():
    return next(c.spec for c in corpus.load() if c.name == NAME)


def test_a_mix_holding_the_second_parents_parameter_is_tagged():
    spec = _case()
    pred = predict_fsdp1(spec)
    assert pred.error is not None and pred.error.path == ""
    assert _shared_parent_mix(spec, pred.error) == {"mix:shared-parent"}


def test_without_the_second_name_it_is_not_tagged():
    spec = dataclasses.replace(_case(), shared=())
    pred = predict_fsdp1(spec)
    assert pred.error is not None and _shared_parent_mix(spec, pred.error) == set()
