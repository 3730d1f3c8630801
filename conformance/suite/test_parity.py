"""PARITY: a few optimizer steps under FSDP1 (both use_orig_params) and FSDP2
match single-process training, frozen and tied parameters included.

Spec: DESIGN.md PARITY; the FSDP1 and fully_shard docstrings (data parallel
training on the same data is single-process training). FSDP2 cases
sometimes force SUM-only collectives (set_force_sum_reduction_for_comms:
gradients still the mean) or set a gradient divide factor
(set_gradient_divide_factor: the sum over ranks divided by it), per their
docstrings.
"""

import pytest
from hypothesis import given, settings

from conformance.areas.common.fsdp2_adapter import has_reduction_setters
from conformance.areas.parity import AREA
from conformance.run import corpus
from conformance.strategies.training import training_specs
from conformance.suite.budget import examples

PARITY = [inv.id for inv in AREA.invariants]

pytestmark = pytest.mark.needs_ranks  # values: the fake tier's collectives carry no data


@settings(max_examples=examples(106))
@corpus.examples(*PARITY)
@given(spec=training_specs(api="fsdp2", reductions=has_reduction_setters()))
def test_training_parity_fsdp2(spec, engine, conformance):
    conformance.check_example(PARITY, spec, engine, engine.tier)


@settings(max_examples=examples(100))
@given(spec=training_specs(api="fsdp1"))
def test_training_parity_fsdp1(spec, engine, conformance):
    conformance.check_example(PARITY, spec, engine, engine.tier)
