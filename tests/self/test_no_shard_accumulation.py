"""FSDP1 units given NO_SHARD (CustomPolicy kwargs) in gradient accumulation:
thorough seed 86's schedule rows (torch 2.13.0, gloo).

- ACCUM and MP-DTYPES: a NO_SHARD unit run in a no_sync() microbatch and
  skipped by the step's last (synchronizing) one: its accumulated gradient is
  never all-reduced (0.437 relative on proj1.weight). That is
  fsdp1-no-sync-unit-unused-in-last-microbatch's mechanism, whose FULL_SHARD
  form is the `_saved_grad_shard` AssertionError; the schedule oracle now tags
  the unit (unit:unsynced-by-last-microbatch, unit:unsynced-no-shard) and the
  AssertionError's rules require the first tag, not just "some microbatch
  skips something".
- MP-PIPELINE: a NO_SHARD unit in two synchronized microbatches under
  bfloat16: each backward rounds the accumulated gradient to reduce_dtype and
  all-reduces it again (fsdp1-no-shard-synced-accumulation-in-reduce-dtype, a
  new finding; its repro loses a 1/512 contribution to a gradient of 1). The
  same row with use_orig_params=False was KNOWN as
  fsdp1-accumulated-grad-wrong-unit-smaller-than-world: the one-element unit
  counted as smaller than the world, but a NO_SHARD unit keeps its whole flat
  parameter on every rank (a KNOWN that swallowed another mechanism).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.schedule.invariants import case_tags
from conformance.areas.schedule.observation import MicrobatchSeen, ScheduleObservation, ValueSeen
from conformance.areas.schedule.oracle import predict_schedule
from conformance.case.model_case import case_from_json
from conformance.run.runner import evaluate

pytestmark = pytest.mark.selfcheck

DATA = Path(__file__).parent / "data"
UNSYNCED = case_from_json((DATA / "schedule-no-shard-unit-unused-in-last-microbatch.json").read_text())
SYNCED = case_from_json((DATA / "schedule-no-shard-synced-accumulation.json").read_text())
SAVED = "AssertionError: All sharded parameters that received a gradient in the post-backward should use `_saved_grad_shard`"


def _tags(spec) -> set[str]:
    return case_tags(spec, predict_schedule(spec))


def _known(res) -> set[str]:
    return {fid for _, fid in res.known}


def _with_step(spec, **changes):
    s = spec.schedule
    return dataclasses.replace(spec, schedule=dataclasses.replace(s, steps=(dataclasses.replace(s.steps[0], **changes),)))


def _no_kwargs(spec):
    return dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, policy=dataclasses.replace(spec.plan.policy, kwargs=())))


def _grad_off(spec, invariant, fqn="proj1.weight", err=0.437, emulated=None):
    """Both ranks: fqn's gradient at step 0 off by err against fp32 training
    (or by emulated against the emulated pipeline); everything else exact."""
    mbs = tuple(MicrobatchSeen(0, k, k == len(spec.schedule.steps[0].microbatches) - 1, (), "float32", 0.0, 0.0)
                for k in range(len(spec.schedule.steps[0].microbatches)))
    obs = [ScheduleObservation(api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0",
                               rounding_noise=(0.0,), microbatches=mbs,
                               grads=(ValueSeen(0, fqn, "float32", False, False, err, emulated_err=emulated),))
           for r in range(2)]
    return evaluate(invariant, spec, obs)


def _raised(spec, invariant, error=SAVED):
    obs = [ScheduleObservation(api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0",
                               step_error=f"step 0 microbatch 1: {error}") for r in range(2)]
    return evaluate(invariant, spec, obs)


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_no_shard_unit_skipped_by_the_synchronizing_microbatch_is_that_finding(invariant):
    assert UNSYNCED.schedule.steps[0].microbatches[-1].skip == ("proj1",)
    assert {"unit:unsynced-by-last-microbatch", "unit:unsynced-no-shard"} <= _tags(UNSYNCED)
    res = _grad_off(UNSYNCED, invariant)
    assert res.verdict == "KNOWN" and _known(res) == {"fsdp1-no-sync-unit-unused-in-last-microbatch"}, res.describe()
    # the last microbatch runs proj1: its gradient is reduced; a wrong one is something else
    runs = _with_step(UNSYNCED, microbatches=(UNSYNCED.schedule.steps[0].microbatches[0],) * 2)
    assert not {"unit:unsynced-by-last-microbatch", "unit:unsynced-no-shard"} & _tags(runs)
    assert _grad_off(runs, invariant).verdict == "FAIL"
    # FULL_SHARD: that form raises the AssertionError; a wrong value is not it
    full = _no_kwargs(UNSYNCED)
    assert "unit:unsynced-by-last-microbatch" in _tags(full) and "unit:unsynced-no-shard" not in _tags(full)
    assert _grad_off(full, invariant).verdict == "FAIL"
    assert _known(_raised(full, invariant)) == {"fsdp1-no-sync-unit-unused-in-last-microbatch"}


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_the_saved_grad_shard_assertion_needs_a_unit_the_last_microbatch_skips(invariant):
    # a microbatch that skips proj1 but is not the last: the synchronizing
    # microbatch runs every unit, so the AssertionError is not that mechanism
    mbs = UNSYNCED.schedule.steps[0].microbatches
    early = _no_kwargs(_with_step(UNSYNCED, microbatches=(mbs[1], mbs[0])))
    assert "skips" in _tags(early) and "unit:unsynced-by-last-microbatch" not in _tags(early)
    assert _raised(early, invariant).verdict == "FAIL"


def test_no_shard_accumulation_across_synchronized_microbatches_is_that_finding():
    assert SYNCED.schedule.precision.param_dtype == "bfloat16" and SYNCED.schedule.steps[0].sync_every
    assert "unit:no-shard-synced-accumulation" in _tags(SYNCED)
    res = _grad_off(SYNCED, "MP-PIPELINE", "proj0.weight", err=0.0, emulated=0.00138)
    assert res.verdict == "KNOWN" and _known(res) == {"fsdp1-no-shard-synced-accumulation-in-reduce-dtype"}, res.describe()
    # use_orig_params=False: the same finding, not the unit-smaller-than-world one (a NO_SHARD unit is not sharded)
    flat = dataclasses.replace(SYNCED, plan=dataclasses.replace(SYNCED.plan, use_orig_params=False))
    assert "unit-smaller-than-world" not in _tags(flat)
    res = _grad_off(flat, "MP-PIPELINE", "<flat parameter of proj0>", err=0.0, emulated=0.00138)
    assert _known(res) == {"fsdp1-no-shard-synced-accumulation-in-reduce-dtype"}, res.describe()
    # FULL_SHARD accumulates the reductions in float32 (the repro's full_shard mode): not that mechanism
    full = _no_kwargs(SYNCED)
    assert "unit:no-shard-synced-accumulation" not in _tags(full)
    assert _grad_off(full, "MP-PIPELINE", "proj0.weight", err=0.0, emulated=0.00138).verdict == "FAIL"
    # one microbatch: nothing accumulated
    one = _with_step(SYNCED, microbatches=SYNCED.schedule.steps[0].microbatches[:1])
    assert "unit:no-shard-synced-accumulation" not in _tags(one)
    assert _grad_off(one, "MP-PIPELINE", "proj0.weight", err=0.0, emulated=0.00138).verdict == "FAIL"


# Thorough seed 86's re-run, once the AssertionError's rules above required
# their mechanism: a forward-only middle microbatch (it skips the only
# trainable Linear) under no_sync and param_dtype bfloat16, then the
# synchronizing one raises the same `_saved_grad_shard` AssertionError with
# every unit run. It had read KNOWN as the unused-in-last-microbatch finding;
# it is fsdp1-mixed-precision-forward-without-backward's no_sync form (checked:
# without param_dtype, or with the middle microbatch running the Linear, it
# trains).
FORWARD_ONLY = case_from_json((DATA / "schedule-forward-only-microbatch-under-no-sync.json").read_text())


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_forward_only_microbatch_under_no_sync_is_the_forward_without_backward_finding(invariant):
    tags = _tags(FORWARD_ONLY)
    assert {"forward-only", "no-sync", "param-dtype-low"} <= tags and "unit:unsynced-by-last-microbatch" not in tags
    res = _raised(FORWARD_ONLY, invariant)
    assert res.verdict == "KNOWN" and _known(res) == {"fsdp1-mixed-precision-forward-without-backward"}, res.describe()
    full = dataclasses.replace(FORWARD_ONLY, schedule=dataclasses.replace(FORWARD_ONLY.schedule, precision=None))
    assert _raised(full, invariant).verdict == "FAIL"


# The re-run after that: 0.weight frozen in the tree (and at step 0) and
# trainable at step 1, whose last microbatch skips its unit. The schedule
# sets requires_grad from each step's own mask, so the unit is one the
# synchronizing microbatch leaves unsynced; the oracle had taken the tree's
# flag for frozen at every step.
UNFROZEN = case_from_json((DATA / "schedule-unit-unfrozen-then-skipped-by-last-microbatch.json").read_text())


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_unit_trainable_at_the_step_counts_whatever_the_tree_says(invariant):
    steps = UNFROZEN.schedule.steps
    assert steps[0].frozen == ("0.weight",) and steps[1].frozen == () and steps[1].microbatches[-1].skip == ("0",)
    assert "unit:unsynced-by-last-microbatch" in _tags(UNFROZEN)
    res = _raised(UNFROZEN, invariant)
    assert _known(res) == {"fsdp1-no-sync-unit-unused-in-last-microbatch"}, res.describe()
    # frozen at step 1 too: nothing of unit 0 to synchronize
    frozen = dataclasses.replace(UNFROZEN, schedule=dataclasses.replace(UNFROZEN.schedule, steps=(steps[0], dataclasses.replace(steps[1], frozen=("0.weight",)))))
    assert "unit:unsynced-by-last-microbatch" not in _tags(frozen)
    assert _raised(frozen, invariant).verdict == "FAIL"


def test_a_float32_re_reduction_is_not_the_synced_accumulation_finding():
    """fsdp1-no-shard-synced-accumulation-in-reduce-dtype is reduce_dtype's
    rounding: with float32 reduction its re-reduction stays within
    MP-PIPELINE's tolerance. Thorough seed 539271 had a float32 NO_SHARD
    case whose 0.494 gradient error read KNOWN as this finding; it was
    fsdp1-no-shard-unused-unit-params-unregistered's dropped gradient (a
    KNOWN that swallowed another mechanism)."""
    fp32 = dataclasses.replace(SYNCED, schedule=dataclasses.replace(SYNCED.schedule, precision=None))
    tags = _tags(fp32)
    assert "unit:no-shard-synced-accumulation" in tags and "reduce-dtype-low" not in tags
    assert "reduce-dtype-low" in _tags(SYNCED)
    res = _grad_off(fp32, "MP-PIPELINE", "proj0.weight", err=0.0, emulated=0.494)
    assert res.verdict == "FAIL", res.describe()


def test_the_steps_after_an_unsynchronized_no_shard_unit_are_that_finding():
    """fsdp1-no-sync-unit-unused-in-last-microbatch's NO_SHARD form leaves
    each rank stepping its replica with its own gradient: the next
    synchronized step's mean gradient is not the emulated pipeline's
    (thorough seed 539271: the corpus case's step 1, 0.000621 on 0.weight).
    Step 0 synchronizing every microbatch, or its last microbatch running
    unit 0, is not that mechanism, and the same error is a FAIL."""
    from conformance.run import corpus

    (case,) = [c for c in corpus.load() if c.name == "fsdp1-no-sync-unit-unused-in-last-microbatch-pipeline"]
    spec = case.spec
    first, *later = spec.schedule.steps
    assert not first.sync_every and first.microbatches[-1].skip == ("0",) and later

    def step1_off(s):
        mbs = tuple(MicrobatchSeen(si, k, st.sync_every or k == len(st.microbatches) - 1, (), "float32", 0.0, 0.0)
                    for si, st in enumerate(s.schedule.steps) for k in range(len(st.microbatches)))
        obs = [ScheduleObservation(api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0", rounding_noise=(0.0,),
                                   microbatches=mbs, grads=(ValueSeen(1, "0.weight", "float32", False, False, 0.0, emulated_err=0.000621),))
               for r in range(2)]
        return evaluate("MP-PIPELINE", s, obs)

    assert "unit:unsynced-no-shard" in _tags(spec)
    res = step1_off(spec)
    assert res.verdict == "KNOWN" and _known(res) == {"fsdp1-no-sync-unit-unused-in-last-microbatch"}, res.describe()
    synced = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, steps=(dataclasses.replace(first, sync_every=True), *later)))
    runs = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, steps=(dataclasses.replace(first, microbatches=first.microbatches[::-1]), *later)))
    for other in (synced, runs):
        assert "unit:unsynced-no-shard" not in _tags(other)
        assert step1_off(other).verdict == "FAIL", other
