"""Real models: every invariant that applies, on each model named with
``--target package.module:attr`` (skipped without one), with Hypothesis
drawing freeze masks, wrap policies, FSDP2 groupings and registered methods
over the model (conformance.strategies.targets), its natural configurations first (test_model_natural:
each wrap class as a policy, each trainable pattern, FSDP2 per wrap class
with every method registered). Results join the same report rows as
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
from conformance.run.models import LIFECYCLE, model_case_strategy, model_invariants, natural_cases, skip_reason
from conformance.run.session import InvariantFailed
from conformance.suite.budget import examples


def _engine(invariant_id, engine, request):
    """The engine an invariant's model cases run on (a SKIP with its reason
    where none applies)."""
    inv = get(invariant_id)
    why = skip_reason(inv, engine.tier) or (ONE_RANK if invariant_id == "RANKS-AGREE" and engine.world_size < 2 else None)
    if why:
        pytest.skip(why)
    return inv, request.getfixturevalue("worlds") if inv.scenario in LIFECYCLE and inv.scenario.startswith("ckpt") else engine


@pytest.mark.parametrize("invariant_id", [inv.id for inv in model_invariants()])
def test_model_natural(invariant_id, model_target, engine, request, conformance):
    """The target's natural configurations (conformance.strategies.targets.natural_model_cases),
    whatever the budget: each is checked, the failures raised together."""
    inv, eng = _engine(invariant_id, engine, request)
    errors = []
    for case in natural_cases(model_target, inv.scenario, tuple(inv.api.split("|"))):
        try:
            conformance.check(invariant_id, case, eng, engine.tier)
        except InvariantFailed as e:
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ExceptionGroup(f"{invariant_id}: {len(errors)} natural configurations fail", errors)


@pytest.mark.parametrize("invariant_id", [inv.id for inv in model_invariants()])
@settings(max_examples=examples(20))
@given(data=st.data())
def test_model(invariant_id, model_target, data, engine, request, conformance):
    inv, eng = _engine(invariant_id, engine, request)
    case = data.draw(model_case_strategy(model_target, inv.scenario, tuple(inv.api.split("|"))), label="model case")
    conformance.check(invariant_id, case, eng, engine.tier)


ONE_RANK = "one rank has nothing to disagree with"
