"""Two schedule findings whose rules named the case only broadly (some freeze
change; some skip under no_sync) now require the schedule oracle's tag for
their mechanism, so that the same error from another cause stays FAIL:

- fsdp1-unfreeze-frozen-unit-orig-params: a unit whose post-backward hook
  state comes from a forward with another requires_grad than the backward
  that next runs (unit:stale-hook-state): an all-frozen forward with no
  backward after it (the loss needs no gradient), then a step that trains it.
  Thorough seed 90 showed the form the finding's summary did not name: the
  unit trains at step 0, is frozen in a forward-only step 1, and trains
  again at step 2.
- fsdp2-no-sync-unrun-group-reduce-dtype: a non-root group none of whose
  modules runs in a microbatch with gradient sync disabled
  (group:unrun-under-no-sync).
- fsdp2-accumulated-grads-mixed-reduce-dtype: a group with a gradient
  accumulated under no_sync (reduce_dtype) and a parameter only the
  synchronizing microbatch uses (a fresh one, param_dtype)
  (group:accumulated-and-fresh).

Each finding's corpus case shows it; with the mechanism taken out of the
schedule and the same error planted, no finding matches.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.schedule.invariants import case_tags
from conformance.areas.schedule.observation import ScheduleObservation
from conformance.areas.schedule.oracle import predict_schedule
from conformance.case.model_case import case_from_json
from conformance.run import corpus
from conformance.run.runner import evaluate

pytestmark = pytest.mark.selfcheck

UNFREEZE = "fsdp1-unfreeze-frozen-unit-orig-params"
UNRUN = "fsdp2-no-sync-unrun-group-reduce-dtype"
MIXED = "fsdp2-accumulated-grads-mixed-reduce-dtype"
HOOK_STATE = "AssertionError: Invalid: ``_post_backward_hook_state``: (<torch.autograd.graph._MultiHandle object>,)"
NO_UNSHARDED = "AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'"
MIXED_DTYPES = "AssertionError: FSDP reduce-scatter expects uniform gradient dtype but got {torch.float32, torch.bfloat16}"


def _case(name):
    """The corpus case of that name (each finding's own case is named after it)."""
    (case,) = [c for c in corpus.load() if c.name == name]
    return case.spec


def _raised(spec, invariant, where, error):
    obs = [ScheduleObservation(api=spec.plan.api, rank=r, world_size=2, backend="gloo", torch_version="2.13.0",
                               step_error=f"{where}: {error}") for r in range(2)]
    return evaluate(invariant, spec, obs)


def _steps(spec, *steps):
    return dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, steps=steps))


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_unfreezing_a_unit_frozen_at_its_first_forward(invariant):
    spec = _case(UNFREEZE)
    first, later = spec.schedule.steps
    assert first.frozen == ("proj.weight",) and later.frozen == ()
    assert "unit:stale-hook-state" in case_tags(spec, predict_schedule(spec))
    res = _raised(spec, invariant, "step 1 microbatch 0", HOOK_STATE)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {UNFREEZE}, res.describe()
    # trainable at the first forward, frozen later: a freeze change, not that mechanism
    other = _steps(spec, later, first)
    tags = case_tags(other, predict_schedule(other))
    assert "freeze-changes" in tags and "unit:stale-hook-state" not in tags
    assert _raised(other, invariant, "step 1 microbatch 0", HOOK_STATE).verdict == "FAIL"


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_group_that_does_not_run_under_no_sync(invariant):
    spec = _case(UNRUN)
    (step,) = spec.schedule.steps
    assert not step.sync_every and step.microbatches[0].skip == ("b",)
    assert "group:unrun-under-no-sync" in case_tags(spec, predict_schedule(spec))
    res = _raised(spec, invariant, "step 0 microbatch 0", NO_UNSHARDED)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {UNRUN}, res.describe()
    # the group skipped by the synchronizing microbatch only: it ran under no_sync
    last = _steps(spec, dataclasses.replace(step, microbatches=step.microbatches[::-1]))
    tags = case_tags(last, predict_schedule(last))
    assert {"no-sync", "skips"} <= tags and "group:unrun-under-no-sync" not in tags
    assert _raised(last, invariant, "step 0 microbatch 1", NO_UNSHARDED).verdict == "FAIL"
    # every microbatch synchronizes: nothing runs with sync disabled
    synced = _steps(spec, dataclasses.replace(step, sync_every=True))
    assert "group:unrun-under-no-sync" not in case_tags(synced, predict_schedule(synced))
    assert _raised(synced, invariant, "step 0 microbatch 0", NO_UNSHARDED).verdict == "FAIL"


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_group_with_accumulated_and_fresh_gradients(invariant):
    spec = _case(MIXED)
    (step,) = spec.schedule.steps
    assert not step.sync_every and step.microbatches[0].skip == ("b",) and step.microbatches[1].skip == ()
    assert "group:accumulated-and-fresh" in case_tags(spec, predict_schedule(spec))
    res = _raised(spec, invariant, "step 0 microbatch 1", MIXED_DTYPES)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {MIXED}, res.describe()
    # b skipped by the synchronizing microbatch instead: every gradient it
    # reduces was accumulated (b's too, or none for b)
    last = _steps(spec, dataclasses.replace(step, microbatches=step.microbatches[::-1]))
    tags = case_tags(last, predict_schedule(last))
    assert {"no-sync", "skips"} <= tags and "group:accumulated-and-fresh" not in tags
    assert _raised(last, invariant, "step 0 microbatch 1", MIXED_DTYPES).verdict == "FAIL"


BETWEEN = case_from_json((Path(__file__).parent / "data" / "schedule-frozen-forward-only-step-between-trained-steps.json").read_text())


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_forward_only_frozen_step_between_two_trained_ones(invariant):
    steps = BETWEEN.schedule.steps
    assert [st.frozen for st in steps] == [(), ("proj0.weight",), ()]
    assert "unit:stale-hook-state" in case_tags(BETWEEN, predict_schedule(BETWEEN))
    res = _raised(BETWEEN, invariant, "step 2 microbatch 0", HOOK_STATE)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {UNFREEZE}, res.describe()
    # no step trains after the frozen one: its stale state meets no backward
    ends = _steps(BETWEEN, *steps[:2])
    assert "unit:stale-hook-state" not in case_tags(ends, predict_schedule(ends))
    assert _raised(ends, invariant, "step 1 microbatch 0", HOOK_STATE).verdict == "FAIL"


FORWARD_ONLY = "fsdp1-mixed-precision-forward-without-backward"


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_trainable_unit_s_hook_registered_by_a_forward_without_backward(invariant):
    """fsdp1-mixed-precision-forward-without-backward needs a backward after
    the forward-only microbatch (unit:stale-trainable-hook), not just one."""
    spec = _case(FORWARD_ONLY)
    (step,) = spec.schedule.steps
    assert step.microbatches[0].skip == ("proj0",) and step.microbatches[1].skip == ()
    assert "unit:stale-trainable-hook" in case_tags(spec, predict_schedule(spec))
    wrong = "RuntimeError: The size of tensor a (2) must match the size of tensor b (4) at non-singleton dimension 0"
    res = _raised(spec, invariant, "step 0 optimizer", wrong)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {FORWARD_ONLY}, res.describe()
    # the forward-only microbatch last: no backward meets its hook
    last = _steps(spec, dataclasses.replace(step, microbatches=step.microbatches[::-1]))
    tags = case_tags(last, predict_schedule(last))
    assert {"forward-only", "param-dtype-low"} <= tags and "unit:stale-trainable-hook" not in tags
    assert _raised(last, invariant, "step 0 optimizer", wrong).verdict == "FAIL"


SMALL = "fsdp1-accumulated-grad-wrong-unit-smaller-than-world"


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_unit_smaller_than_the_world_accumulating_synced_gradients(invariant):
    """The finding needs its small unit used by two synchronized microbatches
    (unit:small-accumulates-synced), not a small unit and some synchronized
    accumulation anywhere."""
    from conformance.areas.schedule.observation import ValueSeen

    spec = _case(SMALL)
    (step,) = spec.schedule.steps
    assert step.sync_every and len(step.microbatches) == 2 and not spec.plan.use_orig_params

    def param_off(s):
        obs = [ScheduleObservation(api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0", rounding_noise=(0.0,),
                                   params=(ValueSeen(0, "proj.weight", "float32", False, False, 0.0196),)) for r in range(2)]
        return evaluate(invariant, s, obs)

    assert "unit:small-accumulates-synced" in case_tags(spec, predict_schedule(spec))
    res = param_off(spec)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {SMALL}, res.describe()
    # the same microbatches under no_sync: accumulation without a synchronized one between
    unsynced = _steps(spec, dataclasses.replace(step, sync_every=False))
    assert "unit:small-accumulates-synced" not in case_tags(unsynced, predict_schedule(unsynced))
    assert param_off(unsynced).verdict == "FAIL"


DROPPED = "fsdp1-synced-accumulation-unused-unit-drops-grad"


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_unit_run_without_its_parameters_after_a_synced_gradient(invariant):
    """fsdp1-synced-accumulation-unused-unit-drops-grad (thorough seed 24226)
    needs a unit that got a gradient in a synchronized microbatch, then runs
    (its output needing a gradient) in a later one of the same step without
    reading its trainable parameters (unit:synced-grad-dropped): the root
    unit, whose only parameter 4.weight the second microbatch passes over.
    The same microbatches in the other order, or under no_sync, are not
    that mechanism, and the same deviation is then a FAIL."""
    from conformance.areas.schedule.observation import ValueSeen
    from conformance.areas.schedule.oracle import units_dropping_synced_grad

    spec = _case(DROPPED)
    (step,) = spec.schedule.steps
    assert step.sync_every and [mb.skip for mb in step.microbatches] == [(), ("4",)] and not spec.plan.use_orig_params

    def param_off(s):
        obs = [ScheduleObservation(api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0", rounding_noise=(0.0,),
                                   params=(ValueSeen(0, "4.weight", "float32", False, False, 1.73e-4),)) for r in range(2)]
        return evaluate(invariant, s, obs)

    assert units_dropping_synced_grad(spec) == ("",)
    assert "unit:synced-grad-dropped" in case_tags(spec, predict_schedule(spec))
    res = param_off(spec)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {DROPPED}, res.describe()
    # 4 skipped first, read second: the gradient comes after the unused run
    first = _steps(spec, dataclasses.replace(step, microbatches=step.microbatches[::-1]))
    # under no_sync: the first microbatch's gradient stays unsharded (fsdp1-no-sync-unit-unused-in-last-microbatch's ground)
    unsynced = _steps(spec, dataclasses.replace(step, sync_every=False))
    # every Linear frozen: nothing before the root's output needs a gradient once 4 is skipped (no pre-backward hook)
    frozen = _steps(spec, dataclasses.replace(step, frozen=("0.weight", "1.weight", "2.weight", "3.weight")))
    for other in (first, unsynced, frozen):
        assert not units_dropping_synced_grad(other)
        assert "unit:synced-grad-dropped" not in case_tags(other, predict_schedule(other))
        assert param_off(other).verdict == "FAIL"


LEFT = "fsdp1-no-shard-unused-unit-params-unregistered"


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_no_shard_unit_run_without_reading_its_parameters(invariant):
    """fsdp1-no-shard-unused-unit-params-unregistered needs a NO_SHARD unit
    under use_orig_params=True that a microbatch runs (its output needing a
    gradient, from the trainable Linear 0 before it) without reading its
    trainable parameters, and a later microbatch that reads them
    (unit:no-shard-left-unsharded): the corpus case's Block 1, whose only
    parameter 1.proj0.weight step 0's first microbatch passes over. The
    same case sharded, with use_orig_params=False, with a low param_dtype,
    with 1.proj0 read in every microbatch, or with Linear 0 frozen is not
    that mechanism, and the same deviation is then a FAIL; on one rank,
    where FSDP1 runs FULL_SHARD as NO_SHARD, the sharded form is."""
    from conformance.areas.schedule.observation import ValueSeen
    from conformance.areas.schedule.oracle import no_shard_units_left_unsharded
    from conformance.case.spec import CustomWrap, Precision

    spec = _case(LEFT)
    first, *later = spec.schedule.steps
    assert spec.plan.use_orig_params and [mb.skip for mb in first.microbatches] == [("1.proj0",), ()] and later
    assert spec.plan.policy.kwargs == (("1", (("sharding_strategy", "NO_SHARD"),)),)

    def off(s, world=2):
        # what the gloo run of the corpus case saw (torch 2.13.0): step 0's value, step 1's gradient
        err = dict(dtype="float32", none=False, ref_none=False)
        obs = [ScheduleObservation(api="fsdp1", rank=r, world_size=world, backend="gloo", torch_version="2.13.0", rounding_noise=(0.0,) * 3,
                                   params=(ValueSeen(0, "1.proj0.weight", err=0.0337, **err),),
                                   grads=(ValueSeen(1, "1.proj0.weight", err=0.684, emulated_err=0.684, **err),)) for r in range(world)]
        return evaluate(invariant, s, obs)

    assert no_shard_units_left_unsharded(spec, 2) == {"1": "unused"}
    assert "unit:no-shard-left-unsharded" in case_tags(spec, predict_schedule(spec))
    res = off(spec)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {LEFT}, res.describe()

    sharded = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, policy=CustomWrap(("1",), (("1", (("sharding_strategy", "FULL_SHARD"),)),))))
    assert no_shard_units_left_unsharded(sharded, 1) == {"1": "unused"}  # one rank: every unit NO_SHARD (the root reads 0.weight always)
    orig_false = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, use_orig_params=False))
    low = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, precision=Precision(param_dtype="bfloat16")))
    read = _steps(spec, dataclasses.replace(first, microbatches=first.microbatches[::-1]), *later)  # read first, then passed over
    read_all = _steps(spec, *(dataclasses.replace(st, microbatches=tuple(dataclasses.replace(mb, skip=()) for mb in st.microbatches))
                              for st in spec.schedule.steps))
    # Linear 0 frozen throughout: the first microbatch's loss needs no gradient once 1.proj0 is passed over (no pre-backward hook)
    frozen = _steps(spec, *(dataclasses.replace(st, frozen=("0.weight",)) for st in spec.schedule.steps))
    # 1.proj0 frozen in step 0: the all-frozen unit's input needs a gradient there (0.weight), so FSDP registers its reshard-only
    # hook on that input instead (on gloo this case, the unit returning its input, is fsdp1-frozen-unit-returning-its-input-fails-backward)
    frozen_unit = _steps(spec, dataclasses.replace(first, frozen=("1.proj0.weight",)), *later)
    for other in (sharded, orig_false, low, read_all, frozen, frozen_unit):
        assert not no_shard_units_left_unsharded(other, 2)
        assert "unit:no-shard-left-unsharded" not in case_tags(other, predict_schedule(other))
        assert off(other).verdict == "FAIL", other
    # passed over in the last microbatch of step 0, read again in step 1: still the mechanism
    assert no_shard_units_left_unsharded(read, 2) == {"1": "unused"}



def _value_off(spec, invariant, kind, step, fqn, err):
    """Both ranks: fqn's gradient ("grad") at ``step`` off by err against fp32
    training and the emulated pipeline, or fqn frozen there with a gradient
    ("frozen-grad"); everything else exact."""
    from conformance.areas.schedule.observation import MicrobatchSeen, ValueSeen

    seen = dict(dtype="float32", none=False, ref_none=kind == "frozen-grad", err=err, emulated_err=err)
    mbs = tuple(MicrobatchSeen(si, k, st.sync_every or k == len(st.microbatches) - 1, (), "float32", 0.0, 0.0)
                for si, st in enumerate(spec.schedule.steps) for k in range(len(st.microbatches)))
    obs = [ScheduleObservation(api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0", rounding_noise=(0.0,) * 3,
                               microbatches=mbs, grads=(ValueSeen(step, fqn, **seen),)) for r in range(2)]
    return evaluate(invariant, spec, obs)


def test_a_parameter_frozen_while_its_no_shard_unit_is_left_unsharded():
    """fsdp1-no-shard-unused-unit-params-unregistered, frozen later (thorough
    seed 539271): step 0 passes over Linear 0, leaving the NO_SHARD root
    unit (0.weight its only parameter) holding plain-tensor views; step 1
    freezes 0.weight through named_parameters(), which lacks it, and reads
    it: the frozen 0.weight gets a gradient. Read in step 0, sharded, or
    frozen from the start (frozen when the unit was left), it is not that
    mechanism."""
    from conformance.areas.schedule.oracle import no_shard_units_left_unsharded

    spec = _case(f"{LEFT}-frozen-later")
    first, later = spec.schedule.steps
    assert first.microbatches[0].skip == ("0",) and later.frozen == ("0.weight",) and not first.frozen
    assert no_shard_units_left_unsharded(spec, 2) == {"": "unused"}
    res = _value_off(spec, "ACCUM", "frozen-grad", 1, "0.weight", 0.0)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {LEFT}, res.describe()
    read = _steps(spec, dataclasses.replace(first, microbatches=(dataclasses.replace(first.microbatches[0], skip=()),)), later)
    sharded = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, sharding_strategy="FULL_SHARD"))
    frozen_throughout = _steps(spec, dataclasses.replace(first, frozen=later.frozen), later)
    for other in (read, sharded, frozen_throughout):
        assert not no_shard_units_left_unsharded(other, 2), other
        assert _value_off(other, "ACCUM", "frozen-grad", 1, "0.weight", 0.0).verdict == "FAIL", other


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES", "MP-PIPELINE"])
def test_the_step_end_summon_drops_a_gradient_given_before_the_unit_was_left_unsharded(invariant):
    """fsdp1-no-shard-unused-unit-params-unregistered, read by the
    summon_full_params(with_grads=True) the step ends with (thorough seed
    539271): the first synchronized microbatch reads 0.weight, the second
    passes over Linear 0 and leaves the root unit holding plain-tensor
    views; the summon reads the gradient as zero and drops it. Under
    no_sync() (that gradient never reduced: the no_sync() finding's), in
    the other order (the existing rule: a later read), or with the second
    microbatch reading 0.weight it is not this rule, and with every
    microbatch reading it the same error is a FAIL."""
    from conformance.areas.schedule.oracle import no_shard_units_left_unsharded

    spec = _case(f"{LEFT}-summon")
    (step,) = spec.schedule.steps
    assert step.sync_every and [mb.skip for mb in step.microbatches] == [(), ("0",)]
    assert no_shard_units_left_unsharded(spec, 2) == {"": "unused"}
    res = _value_off(spec, invariant, "grad", 0, "0.weight", 0.494)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {LEFT}, res.describe()
    unsynced = _steps(spec, dataclasses.replace(step, sync_every=False))
    assert not no_shard_units_left_unsharded(unsynced, 2)
    assert no_shard_units_left_unsharded(_steps(spec, dataclasses.replace(step, microbatches=step.microbatches[::-1])), 2) == {"": "unused"}
    read_all = _steps(spec, dataclasses.replace(step, microbatches=(step.microbatches[0],) * 2))
    assert not no_shard_units_left_unsharded(read_all, 2)
    if invariant != "MP-PIPELINE":  # MP-PIPELINE does not compare a step with an unsynchronized microbatch
        assert _value_off(read_all, invariant, "grad", 0, "0.weight", 0.494).verdict == "FAIL"


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_tied_no_shard_unit_run_without_reading_its_parameters(invariant):
    """The tied form of fsdp1-no-shard-unused-unit-params-unregistered
    (thorough seed 539271): the BlockList unit holds blocklist0.1.weight
    tied to blocklist0.0.weight; the only microbatch skips both Linears, so
    the unit runs without reading its parameters, its input needing a
    gradient, and the step-end summon asserts on the tied name
    (unit:no-shard-tied-left-unsharded). Sharded, untied, in bfloat16, or
    with a Linear read, it is not that mechanism, and the same raise is a
    FAIL."""
    from conformance.areas.schedule.oracle import no_shard_tied_left_unsharded
    from conformance.case.spec import Precision

    spec = _case(f"{LEFT}-tied")
    (step,) = spec.schedule.steps
    assert step.microbatches[0].skip == ("blocklist0.0", "blocklist0.1") and spec.ties
    error = "AssertionError: as_params=True type(prim_param)=<class 'torch.Tensor'>"
    assert no_shard_tied_left_unsharded(spec, 2) == {"unused"}
    tags = case_tags(spec, predict_schedule(spec))
    assert "unit:no-shard-tied-left-unsharded" in tags and "unit:no-shard-frozen-tied-left-unsharded" not in tags
    res = _raised(spec, invariant, "step 0 gradients", error)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {LEFT}, res.describe()
    sharded = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, sharding_strategy="FULL_SHARD"))
    untied = dataclasses.replace(spec, ties=())
    bf16 = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, precision=Precision("bfloat16")))
    reads = _steps(spec, dataclasses.replace(step, microbatches=(dataclasses.replace(step.microbatches[0], skip=("blocklist0.1",)),)))
    for other in (sharded, untied, bf16, reads):
        assert not no_shard_tied_left_unsharded(other, 2), other
        assert _raised(other, invariant, "step 0 gradients", error).verdict == "FAIL", other


FROZEN_LEFT = "fsdp1-no-shard-frozen-unit-params-unregistered"


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_frozen_no_shard_unit_trained_after_it_was_left_unsharded(invariant):
    """fsdp1-no-shard-frozen-unit-params-unregistered in the schedule area:
    a NO_SHARD unit all frozen in a step whose input needs no gradient
    while its output does (the trainable LoRA-like unit 1.lora inside it),
    unfrozen in a later step (unit:no-shard-frozen-left-unsharded). With
    Linear 0 trainable (the unit's input needs a gradient) or 1.proj0
    never unfrozen it is not that mechanism (with Linear 0 trainable the
    same deviation is a FAIL)."""
    from conformance.areas.schedule.observation import ValueSeen
    from conformance.areas.schedule.oracle import no_shard_units_left_unsharded

    (case,) = [c for c in corpus.load() if c.name == f"{FROZEN_LEFT}-unfrozen"]
    spec = case.spec
    first, *later = spec.schedule.steps
    assert set(first.frozen) == {"0.weight", "1.proj0.weight"} and all(st.frozen == ("0.weight",) for st in later)

    def off(s):
        err = dict(dtype="float32", none=False, ref_none=False)
        obs = [ScheduleObservation(api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0", rounding_noise=(0.0,) * 3,
                                   grads=(ValueSeen(1, "1.proj0.weight", err=0.00125, **err),),
                                   params=(ValueSeen(2, "1.proj0.weight", err=0.0015, **err),)) for r in range(2)]
        return evaluate(invariant, s, obs)

    assert no_shard_units_left_unsharded(spec, 2) == {"1": "frozen"}
    tags = case_tags(spec, predict_schedule(spec))
    assert "unit:no-shard-frozen-left-unsharded" in tags and "unit:no-shard-left-unsharded" not in tags
    res = off(spec)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {FROZEN_LEFT}, res.describe()
    input_trains = _steps(spec, *(dataclasses.replace(st, frozen=tuple(f for f in st.frozen if f != "0.weight")) for st in spec.schedule.steps))
    never_unfrozen = _steps(spec, *(dataclasses.replace(st, frozen=first.frozen) for st in spec.schedule.steps))
    assert not no_shard_units_left_unsharded(input_trains, 2) and not no_shard_units_left_unsharded(never_unfrozen, 2)
    assert off(input_trains).verdict == "FAIL"


UNFROZEN_MASK = "fsdp1-no-shard-unfrozen-param-loses-no-sync-grad"


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_no_shard_parameter_unfrozen_then_accumulated_under_no_sync(invariant):
    """fsdp1-no-shard-unfrozen-param-loses-no-sync-grad needs, under
    use_orig_params=True and NO_SHARD, a parameter frozen in a step whose
    gradients FSDP writes back while its unit trains (the summon that reads
    them, or a second microbatch), then a step that unfreezes it and reads
    it in a no_sync() microbatch before another runs the unit
    (unit:no-shard-stale-grad-none-mask). The corpus case (the root's
    NO_SHARD; 0.weight frozen in step 0, unfrozen in step 1) is; sharded,
    with use_orig_params=False, never frozen, with step 1 synchronizing
    every microbatch, or with keep_low_precision_grads (no summon of
    gradients) and one microbatch in step 0, it is not, and the same
    deviation is a FAIL. (MP-PIPELINE cannot see it: FSDP1 promises no
    dtype for no_sync() accumulation, so a step with an unsynchronized
    microbatch has its losses compared, not its gradients.)"""
    from conformance.areas.schedule.observation import ValueSeen
    from conformance.areas.schedule.oracle import no_shard_unfrozen_stale_mask
    from conformance.case.spec import Precision

    spec = _case(UNFROZEN_MASK)
    first, second = spec.schedule.steps
    assert spec.plan.use_orig_params and spec.schedule.sharding_strategy == "NO_SHARD"
    assert "0.weight" in first.frozen and "0.weight" not in second.frozen and not second.sync_every and len(second.microbatches) == 2

    def off(s):
        # what the gloo run of the corpus case saw (torch 2.13.0)
        err = dict(dtype="float32", none=False, ref_none=False)
        obs = [ScheduleObservation(api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0", rounding_noise=(0.0,) * 3,
                                   grads=(ValueSeen(1, "0.weight", err=0.0203, emulated_err=0.0203, **err),),
                                   params=(ValueSeen(1, "0.weight", err=0.00293, **err),)) for r in range(2)]
        return evaluate(invariant, s, obs)

    assert no_shard_unfrozen_stale_mask(spec, 2) == ("0.weight",)
    assert "unit:no-shard-stale-grad-none-mask" in case_tags(spec, predict_schedule(spec))
    res = off(spec)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {UNFROZEN_MASK}, res.describe()

    sharded = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, sharding_strategy="FULL_SHARD"))
    orig_false = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, use_orig_params=False))
    never_frozen = _steps(spec, dataclasses.replace(first, frozen=second.frozen), second)
    synced = _steps(spec, first, dataclasses.replace(second, sync_every=True))
    kept_low = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, precision=Precision("bfloat16", keep_low_precision_grads=True)))
    assert len(first.microbatches) == 1
    for other in (sharded, orig_false, never_frozen, synced, kept_low):
        assert not no_shard_unfrozen_stale_mask(other, 2), other
        assert "unit:no-shard-stale-grad-none-mask" not in case_tags(other, predict_schedule(other))
    # (use_orig_params=False cannot unfreeze: not checked; keep_low_precision_grads has its own dtype and tolerance)
    for other in (sharded, never_frozen, synced):
        assert off(other).verdict == "FAIL", other
    # one rank: FSDP1 runs FULL_SHARD as NO_SHARD
    assert no_shard_unfrozen_stale_mask(sharded, 1) == ("0.weight",)
    # keep_low_precision_grads, and a second microbatch in the frozen step that runs the unit after the first gave it a gradient
    two = _steps(kept_low, dataclasses.replace(first, microbatches=first.microbatches * 2), second)
    assert no_shard_unfrozen_stale_mask(two, 2) == ("0.weight",)


NO_SYNC_UNUSED = "fsdp1-no-sync-unit-unused-in-last-microbatch"


def test_a_frozen_parameter_of_a_no_shard_unit_the_last_microbatch_skips():
    """fsdp1-no-sync-unit-unused-in-last-microbatch's NO_SHARD form with
    use_orig_params=True: the no_sync() post-backward gave every parameter
    of the unit a view of its unreduced gradient, and no synchronizing
    post-backward takes the frozen one's back, so ACCUM sees a frozen
    parameter with a gradient, changed by the step
    (unit:unsynced-no-shard-frozen). Sharded (FULL_SHARD: the AssertionError
    form), or with the last microbatch running the unit, it is not that
    mechanism and the same observation is a FAIL."""
    from conformance.areas.schedule.observation import ValueSeen
    from conformance.areas.schedule.oracle import unsynced_no_shard_frozen

    spec = _case(f"{NO_SYNC_UNUSED}-no-shard-frozen")
    (step,) = spec.schedule.steps
    assert spec.schedule.sharding_strategy == "NO_SHARD" and step.microbatches[-1].skip == ("0",) and "0.weight" in step.frozen

    def off(s):
        obs = [ScheduleObservation(api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0", rounding_noise=(0.0,),
                                   grads=(ValueSeen(0, "0.weight", "bfloat16", False, True, None),),
                                   params=(ValueSeen(0, "0.weight", "float32", False, True, None, unchanged=False),)) for r in range(2)]
        return evaluate("ACCUM", s, obs)

    assert unsynced_no_shard_frozen(spec)
    assert {"unit:unsynced-no-shard", "unit:unsynced-no-shard-frozen"} <= case_tags(spec, predict_schedule(spec))
    res = off(spec)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {NO_SYNC_UNUSED}, res.describe()
    sharded = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, sharding_strategy="FULL_SHARD"))
    last_runs = _steps(spec, dataclasses.replace(step, microbatches=(*step.microbatches[:-1], dataclasses.replace(step.microbatches[-1], skip=()))))
    for other in (sharded, last_runs):
        assert not unsynced_no_shard_frozen(other)
        assert off(other).verdict == "FAIL", other


TIED_NO_SYNC = "fsdp1-no-shard-no-sync-tied-param-low-precision"


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_tied_parameter_of_a_no_shard_unit_accumulated_in_low_precision(invariant):
    """fsdp1-no-shard-no-sync-tied-param-low-precision needs, under
    use_orig_params=True, a NO_SHARD unit holding a tied parameter, a low
    param_dtype without keep_low_precision_grads, and a no_sync()
    microbatch giving the unit a gradient before another that runs it
    (unit:no-shard-unsynced-tied-low-precision). The corpus case is; sharded,
    in float32, with keep_low_precision_grads (the other finding's ground),
    without the tie, or with every microbatch synchronized it is not, and
    the same raise is a FAIL (or the other finding's)."""
    from conformance.areas.schedule.oracle import no_shard_unsynced_tied_low_precision
    from conformance.case.spec import Precision

    spec = _case(TIED_NO_SYNC)
    *_, last = spec.schedule.steps
    assert spec.schedule.sharding_strategy == "NO_SHARD" and spec.ties and not last.sync_every and len(last.microbatches) == 2
    where = f"step {len(spec.schedule.steps) - 1} microbatch 1"
    error = "RuntimeError: attempting to assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'"

    assert no_shard_unsynced_tied_low_precision(spec, 2)
    res = _raised(spec, invariant, where, error)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {TIED_NO_SYNC}, res.describe()

    sharded = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, sharding_strategy="FULL_SHARD"))
    fp32 = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, precision=None))
    kept_low = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, precision=Precision("bfloat16", keep_low_precision_grads=True)))
    untied = dataclasses.replace(spec, ties=())
    synced = _steps(spec, *spec.schedule.steps[:-1], dataclasses.replace(last, sync_every=True))
    for other in (sharded, fp32, kept_low, untied, synced):
        assert not no_shard_unsynced_tied_low_precision(other, 2), other
        assert TIED_NO_SYNC not in {f for _, f in _raised(other, invariant, where, error).known}, other
    for other in (sharded, fp32, untied, synced):
        assert _raised(other, invariant, where, error).verdict == "FAIL", other


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_frozen_tied_no_shard_unit_read_by_the_step_end_summon(invariant):
    """The tied form of fsdp1-no-shard-frozen-unit-params-unregistered in a
    schedule: the root unit, NO_SHARD and all frozen, holds embed0.weight
    tied to model1.tied0; the step's only microbatch leaves it holding
    plain-tensor views, and the summon_full_params(with_grads=True) that
    reads the gradients asserts on the tied name
    (unit:no-shard-frozen-tied-left-unsharded). Sharded, untied, in
    bfloat16, or with the embedding trainable it is not that mechanism, and
    the same raise is a FAIL."""
    from conformance.areas.schedule.oracle import no_shard_tied_left_unsharded
    from conformance.case.spec import Precision

    spec = _case(f"{FROZEN_LEFT}-tied-schedule")
    (step,) = spec.schedule.steps
    assert spec.schedule.sharding_strategy == "NO_SHARD" and spec.ties and "embed0.weight" in step.frozen
    error = "AssertionError: as_params=True type(prim_param)=<class 'torch.Tensor'>"
    assert no_shard_tied_left_unsharded(spec, 2) == {"frozen"}
    assert "unit:no-shard-frozen-tied-left-unsharded" in case_tags(spec, predict_schedule(spec))
    res = _raised(spec, invariant, "step 0 gradients", error)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {FROZEN_LEFT}, res.describe()

    sharded = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, sharding_strategy="FULL_SHARD"))
    untied = dataclasses.replace(spec, ties=())
    bf16 = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, precision=Precision("bfloat16")))
    trains = _steps(spec, dataclasses.replace(step, frozen=tuple(f for f in step.frozen if f != "embed0.weight")))
    for other in (sharded, untied, bf16, trains):
        assert "frozen" not in no_shard_tied_left_unsharded(other, 2), other
        assert _raised(other, invariant, "step 0 gradients", error).verdict == "FAIL", other
    # a different raise at the same place is not this finding's
    assert _raised(spec, invariant, "step 0 gradients", "AssertionError: something else").verdict == "FAIL"


UNSYNCED = "fsdp1-no-sync-unit-unused-in-last-microbatch"


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_an_unsynced_no_shard_unit_keeps_its_low_precision_gradient(invariant):
    """The NO_SHARD form of fsdp1-no-sync-unit-unused-in-last-microbatch
    with a low param_dtype: the unit the synchronizing microbatch skips
    keeps the no_sync() gradient in bfloat16 (its flat gradient's dtype,
    MP-DTYPES) and Adam's step raises on it (both invariants). In fp32,
    or with the last microbatch running the unit, the same observation is
    a FAIL; a different optimizer error is not the finding's."""
    from conformance.areas.schedule.observation import ValueSeen

    spec = _case(f"{UNSYNCED}-no-shard-low-precision")
    (step,) = spec.schedule.steps
    assert spec.schedule.sharding_strategy == "NO_SHARD" and spec.schedule.optimizer == "Adam"
    assert step.microbatches[-1].skip == ("model0",) and not step.sync_every
    error = "RuntimeError: expected dtype float for `end` but got dtype c10::BFloat16"

    def grad_dtype(s):
        obs = [ScheduleObservation(api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0",
                                   grads=(ValueSeen(0, "<flat parameter of model0>", "bfloat16", False, False, None),)) for r in range(2)]
        return evaluate(invariant, s, obs)

    res = _raised(spec, invariant, "step 0 optimizer", error)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {UNSYNCED}, res.describe()
    assert _raised(spec, invariant, "step 0 optimizer", "RuntimeError: something else").verdict == "FAIL"
    runs = _steps(spec, dataclasses.replace(step, microbatches=(step.microbatches[0], dataclasses.replace(step.microbatches[-1], skip=()))))
    fp32 = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, precision=None))
    assert "unit:unsynced-no-shard" not in case_tags(runs, predict_schedule(runs))
    for other in (runs, fp32):
        assert _raised(other, invariant, "step 0 optimizer", error).verdict == "FAIL", other
    if invariant == "MP-DTYPES":
        res = grad_dtype(spec)
        assert res.verdict == "KNOWN" and {f for _, f in res.known} == {UNSYNCED}, res.describe()
        assert grad_dtype(runs).verdict == "FAIL"


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_tied_no_shard_unit_left_unsharded_by_a_microbatch_before_the_last(invariant):
    """The tied form of fsdp1-no-shard-unused-unit-params-unregistered where
    the unit is left so by a microbatch before the step's last (thorough
    seed 191916010): the root unit (NO_SHARD) holds norm2.weight tied to
    norm1.weight, the first microbatch skips both norms, and the next
    microbatch's forward, at its post-forward reshard (_use_sharded_views ->
    _use_unsharded_views(as_params=True) for NO_SHARD), asserts on the tied
    name before the step-end summon is reached. Untied, sharded, or with the
    first microbatch reading norm1, it is not that mechanism and the same
    raise is a FAIL."""
    from conformance.areas.schedule.oracle import no_shard_tied_left_unsharded

    spec = _case(f"{LEFT}-tied-next-forward")
    (step,) = spec.schedule.steps
    assert step.microbatches[0].skip == ("norm1", "norm2") and step.microbatches[-1].skip == () and spec.ties
    error = "AssertionError: as_params=True type(prim_param)=<class 'torch.Tensor'>"
    assert no_shard_tied_left_unsharded(spec, 2) == {"unused"}
    res = _raised(spec, invariant, "step 0 microbatch 1", error)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {LEFT}, res.describe()
    untied = dataclasses.replace(spec, ties=())
    sharded = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, sharding_strategy="FULL_SHARD"))
    first_reads = _steps(spec, dataclasses.replace(step, microbatches=(dataclasses.replace(step.microbatches[0], skip=("norm2",)), *step.microbatches[1:])))
    for other in (untied, sharded, first_reads):
        assert not no_shard_tied_left_unsharded(other, 2), other
        assert _raised(other, invariant, "step 0 microbatch 1", error).verdict == "FAIL", other


@pytest.mark.parametrize("invariant", ["ACCUM", "MP-DTYPES"])
def test_a_frozen_view_read_under_no_sync_gives_the_unit_a_gradient(invariant):
    """fsdp1-no-sync-unit-unused-in-last-microbatch through a frozen
    parameter (thorough seed 914417134, torch 2.13.0, gloo): FULL_SHARD,
    use_orig_params=True; under no_sync() the second microbatch reads only
    the BlockList unit's frozen blocklist0.0.weight, a view of the unit's
    flat parameter, which requires grad (its Linears are trainable), so the
    unit gets a gradient; the last microbatch skips the unit and its
    backward asserts on _saved_grad_shard. With that microbatch skipping
    the whole BlockList, no gradient reaches the unit under no_sync() and
    the same raise is a FAIL."""
    from conformance.areas.schedule.oracle import units_unsynced_by_last_microbatch

    spec = _case(f"{UNSYNCED}-frozen-view")
    (step,) = spec.schedule.steps
    assert step.frozen == ("blocklist0.0.weight",) and step.microbatches[1].skip == ("blocklist0.1",)
    error = "AssertionError: All sharded parameters that received a gradient in the post-backward should use `_saved_grad_shard`"
    assert units_unsynced_by_last_microbatch(spec) == ("blocklist0",)
    res = _raised(spec, invariant, "step 0 microbatch 2", error)
    assert res.verdict == "KNOWN" and {f for _, f in res.known} == {UNSYNCED}, res.describe()
    skipped = _steps(spec, dataclasses.replace(step, microbatches=(step.microbatches[0], dataclasses.replace(step.microbatches[1], skip=("blocklist0",)), step.microbatches[2])))
    assert not units_unsynced_by_last_microbatch(skipped)
    assert _raised(skipped, invariant, "step 0 microbatch 2", error).verdict == "FAIL"
