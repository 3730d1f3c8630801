"""FROZEN-*: mixed requires_grad in one FSDP1 unit.

Spec: spec-sources/000: use_orig_params=False -> ValueError at wrap time naming
the violating module and its frozen / non-frozen parameter names;
use_orig_params=True -> UserWarning with the extra gradient numel; the first
registered violating module in post-order is reported.
"""

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from conformance import corpus
from conformance.oracle import predict_fsdp1
from strategies import case_specs


@pytest.mark.parametrize("invariant_id", ["FROZEN-ERROR"])
@corpus.examples("FROZEN-ERROR")
@given(spec=case_specs(use_orig_params=st.just(False)))
def test_frozen_error(invariant_id, spec, engine, conformance):
    assume(predict_fsdp1(spec).error is not None)
    conformance.check(invariant_id, spec, engine, engine.tier)


@pytest.mark.parametrize("invariant_id", ["FROZEN-WARN"])
@corpus.examples("FROZEN-WARN")
@given(spec=case_specs(use_orig_params=st.just(True)))
def test_frozen_warn(invariant_id, spec, engine, conformance):
    assume(predict_fsdp1(spec).warnings)
    conformance.check(invariant_id, spec, engine, engine.tier)


@pytest.mark.parametrize("invariant_id", ["FROZEN-CLEAN"])
@corpus.examples("FROZEN-CLEAN")
@given(spec=case_specs())
def test_frozen_clean(invariant_id, spec, engine, conformance):
    pred = predict_fsdp1(spec)
    assume(pred.error is None and not pred.warnings)
    conformance.check(invariant_id, spec, engine, engine.tier)
