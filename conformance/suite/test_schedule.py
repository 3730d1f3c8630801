"""MP-DTYPES, MP-PIPELINE and ACCUM: training schedules (optimizer steps,
freeze changes, microbatches with and without gradient sync, mixed
precision) under FSDP1 and FSDP2 against fp32 single-process training on
every rank's data, and (MP-PIPELINE) against an emulation of the promised
mixed-precision pipeline (FSDP1: the gradients of fully synced steps). Each example runs its schedule once;
every invariant of its API is checked on it. Values need real
collectives: real ranks only.

Spec: the MixedPrecisionPolicy / MixedPrecision, no_sync and
set_requires_gradient_sync docstrings (conformance/areas/schedule/invariants.py).
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.areas.schedule import AREA
from conformance.run import corpus
from conformance.strategies.schedule import schedule_specs
from conformance.suite.budget import examples

SCHEDULE = [inv.id for inv in AREA.invariants]
BY_API = {api: [inv.id for inv in AREA.invariants if api in inv.apis] for api in ("fsdp1", "fsdp2")}


@pytest.mark.needs_ranks
# 240: each API at least the examples it had as a test of its own (fsdp2 110, fsdp1 105)
@settings(max_examples=examples(240))
@corpus.examples(*SCHEDULE)
@given(spec=st.one_of(schedule_specs(api="fsdp2"), schedule_specs(api="fsdp1")))
def test_schedule(spec, engine, conformance):
    ids = BY_API[spec.plan.api]
    if conformance.selected is not None and not set(ids) & set(conformance.selected):
        return  # nothing selected applies to this example's API
    conformance.check_example(ids, spec, engine, engine.tier)
