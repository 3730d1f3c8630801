"""MP-DTYPES and ACCUM: training schedules (optimizer steps, freeze changes,
microbatches with and without gradient sync, mixed precision) under FSDP1
and FSDP2 against fp32 single-process training on every rank's data.

Spec: the MixedPrecisionPolicy / MixedPrecision, no_sync and
set_requires_gradient_sync docstrings (conformance/invariants/training.py).
Every example checks both invariants on one run of its schedule. Values need
real collectives: real ranks only.
"""

import pytest
from hypothesis import given, settings, strategies as st

from conformance.run import corpus
from conformance.suite.budget import examples
from strategies.schedule import schedule_specs

TRAINING = ["MP-DTYPES", "ACCUM"]


def _missing_api() -> str | None:
    from conformance.areas.schedule.adapter import missing_api

    return missing_api()


@pytest.mark.needs_ranks
@settings(max_examples=examples(200))
@corpus.examples(*TRAINING)
@given(spec=st.one_of(schedule_specs(api="fsdp2"), schedule_specs(api="fsdp1")))
def test_schedule(spec, engine, conformance):
    reason = _missing_api()
    if reason:  # an API the installed torch lacks: a SKIP with its reason
        pytest.skip(reason)
    for invariant_id in TRAINING:
        conformance.check(invariant_id, spec, engine, engine.tier)
