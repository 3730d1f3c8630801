"""Real models: every invariant that applies, on each model named with
``--target package.module:attr`` (skipped without one), with Hypothesis
drawing freeze masks, wrap policies, FSDP2 groupings and registered methods
over the model (strategies.targets). Results join the same report rows as
the synthetic cases; a finding's case is the ModelCase, its repro script
imports the target.

Spec: the invariant catalog (each invariant's own source); the target's
methods are checked for what FSDP promises whatever their body runs
(conformance.areas.common.fsdp2_oracle: opaque calls).
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.areas import get
from conformance.run.models import model_invariants
from conformance.suite.budget import examples
from strategies.targets import model_cases


@pytest.mark.parametrize("invariant_id", [inv.id for inv in model_invariants()])
@settings(max_examples=examples(20))
@given(data=st.data())
def test_model(invariant_id, model_target, data, engine, conformance):
    if invariant_id == "RANKS-AGREE" and (engine.tier == "fake" or engine.world_size < 2):
        pytest.skip("one rank has nothing to disagree with")
    apis = get(invariant_id).api.split("|")
    case = data.draw(model_cases(model_target, apis=st.sampled_from(apis)), label="model case")
    conformance.check(invariant_id, case, engine, engine.tier)
