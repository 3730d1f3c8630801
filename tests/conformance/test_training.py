"""MP-DTYPES and ACCUM: training schedules (steps, freeze changes,
microbatches with and without gradient sync, mixed precision) under FSDP1
and FSDP2 against fp32 single-process training on every rank's data.

Spec: the MixedPrecisionPolicy / MixedPrecision, no_sync and
set_requires_gradient_sync docstrings (conformance/invariants/training.py).
Every example checks both invariants on one run of the schedule.
"""

import pytest
from hypothesis import given, settings

from strategies.schedule import schedule_specs
from tests.conformance.budget import examples

TRAINING = ["MP-DTYPES", "ACCUM"]


@pytest.mark.parametrize("api", ["fsdp2", "fsdp1"])
@settings(max_examples=examples(100))
@given(data=__import__("hypothesis").strategies.data())
def test_schedule(api, data, engine, conformance):
    spec = data.draw(schedule_specs(api=api), label="case with schedule")
    for invariant_id in TRAINING:
        conformance.check(invariant_id, spec, engine, engine.tier)
