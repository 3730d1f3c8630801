"""TIES: a parameter shared between modules under FSDP1.

Spec: spec-sources/000 (ezyang: "We are assuming no weight tying?" awgu: "for
shared parameters, FSDP needs them to be assigned to at least the lowest
common ancestor module or higher"); DESIGN.md TIES: managed once, or rejected
with a clear error; silent duplication is a finding.
"""

import pytest
from hypothesis import assume, given

from conformance.run import corpus
from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from strategies import case_specs


@pytest.mark.parametrize("invariant_id", ["TIES"])
@corpus.examples("TIES")
@given(spec=case_specs())
def test_ties(invariant_id, spec, engine, conformance):
    assume(predict_fsdp1(spec).ties)
    conformance.check(invariant_id, spec, engine, engine.tier)
