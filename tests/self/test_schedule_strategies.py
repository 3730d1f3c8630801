"""The schedule strategy: valid CaseSpecs whose draws all have consequences
(steps, freeze changes, skips, precision), and argument checks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import InvalidArgument

from conformance.areas.schedule.oracle import predict_schedule, used_params
from conformance.case.spec import CaseSpec
from conformance.strategies.schedule import schedule_specs

# find() where any example with the property serves: the first drawn, not shrunk
FIRST = (Phase.generate,)

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


def test_a_microbatch_can_pass_over_every_child_of_a_module_that_still_runs():
    """Conditional computation (an MoE layer routing to none of its
    experts): a microbatch may skip every child of one module, more than
    the 1..2 random registrations otherwise drawn, while the module itself
    runs; an FSDP1 unit whose parameters all sit there runs without reading
    any of them (the ground of fsdp1-synced-accumulation-unused-unit-drops-grad
    and fsdp1-no-shard-unused-unit-params-unregistered)."""
    from hypothesis import find
    from hypothesis import strategies as st

    from conformance.strategies.schedule import _draw_skip

    experts = ("moe.e0", "moe.e1", "moe.e2")
    skippable = ["moe", *experts, "head"]
    parents = [("moe", "head"), experts]
    skips = st.composite(lambda draw: _draw_skip(draw, skippable, parents))()
    quiet = settings(database=None, max_examples=500, suppress_health_check=list(HealthCheck))
    assert find(skips, lambda s: s == experts, settings=quiet) == experts
    assert find(skips, lambda s: len(s) == 2 and s != ("moe", "head"), settings=quiet)  # two random registrations still
    assert find(skips, lambda s: True, settings=quiet) == ()  # shrinks to no skip


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_fsdp1_schedules_draw_the_root_s_sharding_strategy(strategy):
    """FSDP1 schedules give the root each ShardingStrategy, which every unit
    without a CustomWrap kwarg inherits (unit_strategy), and the repro script
    passes it to FSDP: the NO_SHARD form reduces whole flat gradients
    (MP-PIPELINE compares them unsharded), ZeRO-2 keeps parameters unsharded
    between forward and backward. The field is FSDP1's: an FSDP2 schedule
    with another strategy is not a valid spec."""
    import dataclasses

    from hypothesis import find

    from conformance.areas.schedule.oracle import unit_strategy
    from conformance.areas.schedule.repro import schedule_script
    from conformance.case.spec import CustomWrap, SpecError, validate

    # no CustomWrap: its kwargs may give the root a strategy of its own (unit_strategy)
    spec = find(schedule_specs(api="fsdp1"), lambda s: s.schedule.sharding_strategy == strategy and not isinstance(s.plan.policy, CustomWrap),
                settings=settings(max_examples=500, database=None, suppress_health_check=list(HealthCheck), phases=FIRST))
    assert unit_strategy(spec, "") == strategy
    script = schedule_script(spec, [], "ACCUM")
    assert (f"sharding_strategy=ShardingStrategy.{strategy}" in script) == (strategy != "FULL_SHARD")
    two = find(schedule_specs(api="fsdp2"), lambda s: True, settings=settings(max_examples=5, database=None, phases=FIRST))
    assert two.schedule.sharding_strategy == "FULL_SHARD"
    if strategy != "FULL_SHARD":
        with pytest.raises(SpecError, match="sharding_strategy"):
            validate(dataclasses.replace(two, schedule=dataclasses.replace(two.schedule, sharding_strategy=strategy)))


def test_bad_arguments_are_rejected():
    with pytest.raises(InvalidArgument):
        schedule_specs(api="fsdp3")
    with pytest.raises(InvalidArgument):
        schedule_specs(max_steps=0)


def test_fsdp1_flat_parameters_give_unused_parameters_of_a_used_unit_a_zero_gradient():
    """Per step, the trainable parameters a step does not use while their
    unit's others are used (FSDP1 reduces whole FlatParameters); the
    reference gives them zeros only where the optimizer sees FlatParameters."""
    import dataclasses

    from conformance.case.spec import ClassSpec, CustomWrap, Microbatch, ModuleSpec, ParamSpec, Schedule, ScheduleStep, WrapPlan

    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(
        ModuleSpec("block", "Block", (ParamSpec("w", (3,)),), children=(ModuleSpec("proj", "Linear", (ParamSpec("weight", (3, 3)),)),)),
        ModuleSpec("head", "Linear", (ParamSpec("weight", (4, 3)),)),
    ))
    steps = (ScheduleStep(), ScheduleStep(microbatches=(Microbatch(("block.proj",)),)), ScheduleStep(microbatches=(Microbatch(("block",)),)),
             ScheduleStep(("block.w",), (Microbatch(("block.proj",)),)))
    for uop in (False, True):
        spec = CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), seed=0, schedule=Schedule(steps),
                        plan=WrapPlan(api="fsdp1", policy=CustomWrap(("block",)), use_orig_params=uop))
        if not uop:  # requires_grad is fixed at wrap time there: no freeze changes
            spec = dataclasses.replace(spec, schedule=Schedule(steps[:3]))
        pred = predict_schedule(spec)
        # step 2 skips the whole block unit: no gradient there at all; step 3
        # freezes its only other parameter, which the forward still reads:
        # the FlatParameter gets a gradient all the same (checked on gloo,
        # torch 2.13.0: SGD's momentum moves block.proj.weight there)
        want = ((), ("block.proj.weight",), ()) + ((("block.proj.weight",),) if uop else ())
        assert pred.unused_in_used_unit == want
        assert pred.reference_zero_grads is (not uop)
    fsdp2 = CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), seed=0, schedule=Schedule(steps[:2]), plan=WrapPlan(api="fsdp2"))
    assert predict_schedule(fsdp2).unused_in_used_unit == () and not predict_schedule(fsdp2).reference_zero_grads


@pytest.mark.parametrize("api", ["fsdp1", "fsdp2"])
def test_schedules_draw_roots_whose_inputs_fsdp_promises_not_to_cast(api):
    """FSDP2 cast_forward_inputs=False and FSDP1 cast_root_forward_inputs=False
    with a low param_dtype: the test feeds float32 and casts after FSDP's
    pre-forward itself (MP-DTYPES kind:root-input-cast), the generated repro
    too. FSDP1 draws both a root that manages parameters with
    cast_forward_inputs=True (fsdp1-root-casts-inputs-despite-cast-root-false's
    form) and a root that manages none."""
    from hypothesis import find

    from conformance.areas.schedule.invariants import case_tags
    from conformance.areas.schedule.repro import schedule_script

    def no_root_cast(s):
        return s.schedule.first < 0 and predict_schedule(s).input_dtype != "float32"

    quiet = settings(max_examples=2000, database=None, suppress_health_check=list(HealthCheck), phases=FIRST)
    spec = find(schedule_specs(api=api), no_root_cast, settings=quiet)
    pr = spec.schedule.precision
    assert (pr.cast_forward_inputs is False) if api == "fsdp2" else not pr.cast_root_forward_inputs
    assert "USER_CASTS = True" in schedule_script(spec, [], "MP-DTYPES")
    if api == "fsdp1":
        form = find(schedule_specs(api=api), lambda s: no_root_cast(s) and "root:casts-by-cast-forward-inputs" in case_tags(s, predict_schedule(s)),
                    settings=quiet)
        assert form.schedule.precision.cast_forward_inputs
        find(schedule_specs(api=api), lambda s: no_root_cast(s) and s.schedule.precision.cast_forward_inputs
             and "root:casts-by-cast-forward-inputs" not in case_tags(s, predict_schedule(s)), settings=quiet)
