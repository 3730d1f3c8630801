"""RANKS-AGREE: every rank builds the same FSDP1 units (FSDP is SPMD: a unit
one rank has and another lacks means unmatched collectives). Needs real ranks:
runs on the gloo pool only (the fake tier is one rank)."""

import pytest
from hypothesis import given

from conformance.run import corpus
from strategies import case_specs

pytestmark = [pytest.mark.needs_ranks, pytest.mark.several_ranks]


@pytest.mark.parametrize("invariant_id", ["RANKS-AGREE"])
@corpus.examples("RANKS-AGREE")
@given(spec=case_specs())
def test_invariant(invariant_id, spec, engine, conformance):
    conformance.check(invariant_id, spec, engine, engine.tier)
