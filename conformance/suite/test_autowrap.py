"""FSDP1 auto-wrapping: the units and what each manages (WRAP-*), the
frozen-parameter error and warnings (FROZEN-*), tied parameters (TIES), every
rank building the same units (RANKS-AGREE). Each example wraps its case once
and every invariant of the area is checked on that one observation.

Spec: spec-sources/000 (post-order wrapping; ezyang's invariant that the
pre-wrap simulation agrees with the wrapped model; use_orig_params=False ->
ValueError naming the first violating module in post-order and its frozen /
non-frozen names; use_orig_params=True -> UserWarning with the extra gradient
numel; awgu: shared parameters belong at their users' lowest common ancestor
or higher), the FullyShardedDataParallel and CustomPolicy docstrings.
"""

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conformance.areas.autowrap import AREA
from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.run import corpus
from conformance.strategies import case_specs
from conformance.strategies.frozen_units import mixed_unit_cases, several_mixed_units
from conformance.suite.budget import examples

AUTOWRAP = [inv.id for inv in AREA.invariants]


@corpus.examples(*AUTOWRAP)
@given(spec=case_specs())
def test_wrapping(spec, engine, conformance):
    conformance.check_example(AUTOWRAP, spec, engine, engine.tier)


@given(spec=mixed_unit_cases(use_orig_params=st.just(False)))
def test_mixed_unit_is_an_error(spec, engine, conformance):
    """A unit mixes requires_grad under use_orig_params=False: the oracle says
    FSDP1 must reject the plan, naming the first violating unit."""
    conformance.check_example(AUTOWRAP, spec, engine, engine.tier)


@given(spec=mixed_unit_cases(use_orig_params=st.just(True)))
def test_mixed_unit_is_a_warning(spec, engine, conformance):
    """A unit mixes requires_grad under use_orig_params=True: warnings."""
    conformance.check_example(AUTOWRAP, spec, engine, engine.tier)


@settings(max_examples=examples(300))
@given(spec=case_specs(require_ties=True))
def test_tied_parameters(spec, engine, conformance):
    assume(predict_fsdp1(spec).ties)
    conformance.check_example(AUTOWRAP, spec, engine, engine.tier)


@settings(max_examples=examples(100))
@given(spec=several_mixed_units(use_orig_params=st.booleans()))
def test_several_mixed_units(spec, engine, conformance):
    """2..4 mixed units: the first violator (error) and the warnings' order."""
    conformance.check_example(AUTOWRAP, spec, engine, engine.tier)
