"""The schedule strategy: valid CaseSpecs whose draws all have consequences
(steps, freeze changes, skips, precision), and argument checks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import InvalidArgument

from conformance.oracle.schedule import predict_schedule, used_params
from conformance.spec import CaseSpec
from strategies.schedule import schedule_specs

pytestmark = pytest.mark.selfcheck


@pytest.mark.parametrize("api", ["fsdp1", "fsdp2"])
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=__import__("hypothesis").strategies.data())
def test_schedules_are_valid_and_train(api, data):
    spec = data.draw(schedule_specs(api=api))
    assert CaseSpec.from_json(spec.to_json()) == spec
    assert spec.plan.api == api and spec.schedule is not None
    pred = predict_schedule(spec)
    assert not pred.applicable, pred.applicable
    for st in spec.schedule.steps:
        # the synchronizing microbatch runs backward whenever anything trains
        assert used_params(spec, st.microbatches[-1].skip) - set(st.frozen) or not set(pred.trainable) - set(st.frozen) or not used_params(spec, ()) - set(st.frozen)
    if api == "fsdp1" and not spec.plan.use_orig_params:
        assert len({st.frozen for st in spec.schedule.steps}) == 1  # flat parameters: requires_grad fixed


def test_bad_arguments_are_rejected():
    with pytest.raises(InvalidArgument):
        schedule_specs(api="fsdp3")
    with pytest.raises(InvalidArgument):
        schedule_specs(max_steps=0)
