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
from conformance.run.models import LIFECYCLE, model_case_strategy, model_invariants, skip_reason
from conformance.suite.budget import examples


@pytest.fixture(scope="module")
def worlds(engine):
    """Checkpoint cases are saved on one world size and loaded on another."""
    from conformance.engine.worlds import Worlds

    w = Worlds(engine)
    yield w
    w.close()


@pytest.mark.parametrize("invariant_id", [inv.id for inv in model_invariants()])
@settings(max_examples=examples(20))
@given(data=st.data())
def test_model(invariant_id, model_target, data, engine, request, conformance):
    inv = get(invariant_id)
    why = skip_reason(inv, engine.tier) or (ONE_RANK if invariant_id == "RANKS-AGREE" and engine.world_size < 2 else None)
    if why:
        pytest.skip(why)
    eng = request.getfixturevalue("worlds") if inv.scenario in LIFECYCLE and inv.scenario.startswith("ckpt") else engine
    case = data.draw(model_case_strategy(model_target, inv.scenario, tuple(inv.api.split("|"))), label="model case")
    conformance.check(invariant_id, case, eng, engine.tier)


ONE_RANK = "one rank has nothing to disagree with"
