"""FROZEN-*: mixed requires_grad in one FSDP1 unit.

Spec: spec-sources/000: use_orig_params=False -> ValueError at wrap time naming
the violating module and its frozen / non-frozen parameter names;
use_orig_params=True -> UserWarning with the extra gradient numel; the first
registered violating module in post-order is reported.
"""

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from conformance.run import corpus
from conformance.areas.common.fsdp1_oracle import predict_fsdp1
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


# ---- issue 10: several mixed units (the first-violator and warning order) ----
from strategies.frozen_units import several_mixed_units  # noqa: E402
from conformance.suite.budget import examples  # noqa: E402
from hypothesis import settings  # noqa: E402


@pytest.mark.parametrize("invariant_id", ["FROZEN-ERROR"])
@settings(max_examples=examples(100))
@given(spec=several_mixed_units(use_orig_params=st.just(False)))
def test_frozen_error_first_of_several(invariant_id, spec, engine, conformance):
    conformance.check(invariant_id, spec, engine, engine.tier)


@pytest.mark.parametrize("invariant_id", ["FROZEN-WARN"])
@settings(max_examples=examples(100))
@given(spec=several_mixed_units(use_orig_params=st.just(True)))
def test_frozen_warn_order_of_several(invariant_id, spec, engine, conformance):
    conformance.check(invariant_id, spec, engine, engine.tier)
# ---- end issue 10 ----
