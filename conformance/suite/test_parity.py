"""PARITY: a few optimizer steps under FSDP1 (both use_orig_params) and FSDP2
match single-process training, frozen and tied parameters included.

Spec: DESIGN.md PARITY; the FSDP1 and fully_shard docstrings (data parallel
training on the same data is single-process training). On the fake tier
collectives carry no data: only the frozen-gradient part applies there.
FSDP2 cases sometimes force SUM-only collectives (set_force_sum_reduction_for_comms:
gradients still the mean) or set a gradient divide factor (set_gradient_divide_factor:
the sum over ranks divided by it), per their docstrings.
"""

import pytest
from hypothesis import given, settings

from conformance.run import corpus
from conformance.areas.common.fsdp2_adapter import has_reduction_setters
from strategies.methods import training_specs
from conformance.suite.budget import examples


@pytest.mark.parametrize("invariant_id", ["PARITY"])
@settings(max_examples=examples(100))
@corpus.examples("PARITY")
@given(spec=training_specs(api="fsdp2", reductions=has_reduction_setters()))
def test_training_parity_fsdp2(invariant_id, spec, engine, conformance):
    conformance.check(invariant_id, spec, engine, engine.tier)


@pytest.mark.parametrize("invariant_id", ["PARITY"])
@settings(max_examples=examples(100))
@corpus.examples("PARITY")
@given(spec=training_specs(api="fsdp1"))
def test_training_parity_fsdp1(invariant_id, spec, engine, conformance):
    conformance.check(invariant_id, spec, engine, engine.tier)
