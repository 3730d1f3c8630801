"""The schedule adapter reads FSDP1's unsharded gradients
(summon_full_params(with_grads=True)) only when every rank's flat gradients
are what that unshards, a gradient of the sharded flat parameter's shape and
dtype. A rank holding another (fsdp1-mixed-precision-forward-without-backward
leaves the unreduced, unsharded, low-precision gradient in the FlatParameter)
raised inside summon_full_params while the others waited in its all-gather:
seed 33 of the ci profile on torch 2.13.0 reported that as a 60 s HANG of
MP-DTYPES, MP-PIPELINE and ACCUM. Now every rank stops at the same point with
FlatGradNotSharded, which names the gradient, and the finding explains it."""

from __future__ import annotations

import pytest

from conformance.areas.schedule.observation import ScheduleObservation
from conformance.run import corpus
from conformance.run.runner import KNOWN, evaluate, observations

pytestmark = [pytest.mark.selfcheck, pytest.mark.gloo]

FINDING = "fsdp1-mixed-precision-forward-without-backward"


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(2)


def test_a_flat_gradient_summon_cannot_unshard_stops_every_rank_with_its_finding(pool):
    spec = next(c.spec for c in corpus.load() if c.name == "fsdp1-mixed-precision-forward-only-unsharded-flat-grad")
    obs = observations(pool, spec, "schedule", ScheduleObservation.from_dict)  # a HANG raised RankHang here
    assert all(o.step_error and "step 1 gradients: FlatGradNotSharded" in o.step_error for o in obs), [o.step_error for o in obs]
    assert "bfloat16 [14], its sharded flat parameter float32 [7]" in obs[0].step_error
    for invariant in ("MP-DTYPES", "ACCUM"):
        res = evaluate(invariant, spec, obs)
        assert res.verdict == KNOWN and {fid for _, fid in res.known} == {FINDING}, res.describe()


def test_without_the_forward_only_microbatch_the_gradients_are_read(pool):
    import dataclasses

    spec = next(c.spec for c in corpus.load() if c.name == "fsdp1-mixed-precision-forward-only-unsharded-flat-grad")
    steps = tuple(dataclasses.replace(st, microbatches=tuple(m for m in st.microbatches if m.skip != ("0",))) for st in spec.schedule.steps)
    spec = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, steps=steps))
    obs = observations(pool, spec, "schedule", ScheduleObservation.from_dict)
    assert not any(o.step_error for o in obs), [o.step_error for o in obs]
    assert any(g.err is not None for g in obs[0].grads)  # summon_full_params(with_grads=True) ran: values compared
    assert evaluate("MP-DTYPES", spec, obs).verdict != "FAIL"
