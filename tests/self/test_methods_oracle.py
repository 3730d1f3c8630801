"""The FSDP2 / forward-method strategies and oracle on their own: drawn cases
are valid, round-trip and respect their promises; the oracle's predictions
for a hand-written case."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings

from conformance.areas.common.fsdp2_oracle import predict_fsdp2
from conformance.areas.summon.oracle import predict_summon
from conformance.case.spec import CaseSpec, ForwardMethod, MethodCall, MethodStep, ShardGroup
from conformance.strategies.groups import fsdp2_case_specs
from conformance.strategies.summon import summon_specs
from conformance.strategies.training import training_specs
from tests.self.test_faults_fsdp2 import lm

pytestmark = pytest.mark.selfcheck


@settings(max_examples=40)
@given(spec=fsdp2_case_specs())
def test_fsdp2_cases_are_valid_and_promised(spec):
    assert CaseSpec.from_json(spec.to_json()) == spec
    assert eval(repr(spec), {**vars(__import__("conformance.case.spec", fromlist=["*"]))}) == spec
    pred = predict_fsdp2(spec, "2.13.0")
    assert not pred.split_ties  # split_ties=False
    assert not pred.supported, pred.supported  # the first call runs the root's hooks
    assert {c.method for c in spec.calls} >= set(range(len(spec.methods)))


@settings(max_examples=20)
@given(spec=training_specs(api="fsdp1"))
def test_training_cases_have_a_plan(spec):
    assert spec.train is not None and spec.plan.api == "fsdp1" and not spec.methods


@settings(max_examples=20)
@given(spec=summon_specs())
def test_summon_cases_put_the_method_on_the_root(spec):
    assert [m.module for m in spec.methods] == [""]


def test_oracle_on_the_lm_case():
    spec = lm()
    pred = predict_fsdp2(spec, "2.13.0")
    assert [g.modules for g in pred.groups] == [("block",), ("",)]
    assert set(pred.groups[0].managed) == {"block.w", "block.proj0.weight", "block.proj0.bias"}
    assert pred.groups[0].frozen == ("block.proj0.bias",) and pred.groups[1].reshard is False
    forward, gen1, gen2, feats, score = pred.calls
    assert (forward.unshards, forward.sharded_after) == (2, (True, False))  # root and block gathered; block resharded
    assert (gen1.unshards, gen2.unshards) == (1, 1)  # the root stays unsharded; block is gathered per call
    assert feats.unshards == 1 and all(r.full for r in feats.reads)
    assert not score.fsdp_module and not score.patched and score.in_promise  # note is in the unsharded root group


def test_oracle_keeps_a_method_unsharded_across_self_calls():
    # the promise behind finding fsdp2-forward-method-calls-self
    m = ForwardMethod("block", "forward_features", (MethodStep("call"), MethodStep("param", "w")))
    pred = predict_fsdp2(lm(methods=(m,), calls=(MethodCall(-1), MethodCall(0))), "2.13.0")
    call = pred.calls[1]
    assert call.unshards == 1 and [r.full for r in call.reads if r.step == 1] == [True]


def test_split_tie_prediction_depends_on_the_release():
    spec = lm(groups=(ShardGroup(("embed",)),))
    assert predict_fsdp2(spec, "2.13.0").tie_outcomes == ("error",)
    assert predict_fsdp2(spec, "2.12.1").tie_outcomes == ("error",)  # measured: 2.12.1 rejects it
    assert predict_fsdp2(spec, "2.11.0").tie_outcomes == ("error", "once")
    assert predict_fsdp2(spec, "2.5.1+cu121").tie_outcomes == ("error", "once")


def test_summon_promise_is_the_root_unit():
    from conformance.case.spec import CustomWrap

    reads = lambda *t: ForwardMethod("", "generate", tuple(MethodStep("param", x) for x in t))
    base = lm(api="fsdp1", policy=CustomWrap(("block",)), uop=True, calls=(MethodCall(0),), methods=(reads("embed.weight"),))
    assert predict_summon(base).calls[0].in_promise
    nested = dataclasses.replace(base, methods=(reads("block.w"),))
    assert not predict_summon(nested).calls[0].in_promise


def test_gradients_are_promised_only_through_a_methods_own_group():
    """Found by the thorough profile: a root method that reads a nested
    group's parameter directly (reshard_after_forward=False keeps it
    unsharded) between two forwards of that module; the group's
    post-backward frees it while the read still needs it. Outputs are
    promised, gradients are not (spec source 004: FSDP's hooks run around the
    module's own forward and the registered method, nothing else)."""
    import json
    from pathlib import Path

    case = json.loads((Path(__file__).with_name("data") / "fwd-reads-other-group.json").read_text())
    spec = CaseSpec.from_json(json.dumps(case))
    assert not predict_fsdp2(spec, "2.13.0").backward_promised
    own = dataclasses.replace(spec, methods=tuple(dataclasses.replace(m, steps=tuple(s for s in m.steps if s.op != "param")) for m in spec.methods))
    assert predict_fsdp2(own, "2.13.0").backward_promised


def _shared_group_case(register: bool) -> CaseSpec:
    """b is registered first as a.shared0 (a comes first), then as b; the
    plan names its group by the second path, and so does the method."""
    from conformance.case.spec import ClassSpec, ModuleSpec, ParamSpec, SharedModule, WrapPlan

    tree = ModuleSpec("", "Model", children=(
        ModuleSpec("a", "Block", (ParamSpec("w", (3,)),)),
        ModuleSpec("b", "Block", (ParamSpec("w", (3,)),)),
    ))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), shared=(SharedModule("a", "shared0", "b"),),
                    plan=WrapPlan(api="fsdp2", groups=(ShardGroup(("b",), True),)),
                    methods=(ForwardMethod("b", "score", (MethodStep("param", "w"),), register=register),),
                    calls=(MethodCall(-1), MethodCall(0)))


def test_a_shared_fsdp_module_is_one_under_each_of_its_names(fake_engine):
    """FWD-NOOP read 'registering score on non-FSDP module b patched it' (seed
    3): the group's canonical path is a.shared0, the method names it b."""
    from conformance.run.runner import PASS, UNCHECKED, check_case

    spec = _shared_group_case(register=True)
    pred = predict_fsdp2(spec, "2.13.0")
    assert "a.shared0" in pred.fsdp_modules and "b" not in pred.fsdp_modules
    assert {"a.shared0", "b"} <= set(pred.fsdp_paths)
    # b is the FSDP module a.shared0: nothing is registered on a non-FSDP
    # module (FWD-NOOP compares nothing), and its missing name raises
    for inv, want in (("FWD-NOOP", UNCHECKED), ("FWD-MISSING", PASS)):
        res = check_case(inv, spec, fake_engine)
        assert res.verdict == want, res.describe()


def test_list_group_after_a_method_that_runs_it_in_part():
    """generate() (after a forward, before backward) runs block but not note,
    of the list group [block, note]: the method's root post-forward completes
    the group, so it is predicted sharded after the call (the mutant
    fwd-post-forward-state-not-reset left it unsharded); inside the method
    call, block is unsharded."""
    spec = lm(groups=(ShardGroup(("block", "note"), True),), calls=(MethodCall(-1), MethodCall(0)))
    pred = predict_fsdp2(spec, "2.13.0")
    gi = pred.group_index("block")
    assert pred.groups[gi].modules == ("block", "note")
    assert [c.sharded_after[gi] for c in pred.calls] == [True, True]
    assert not any(c.root_group_partial for c in pred.calls)


def test_a_backward_through_another_groups_parameter_is_outside_every_gradient_check(fake_engine):
    """Seed 12 (ci profile): a registered root method reads proj3.weight (proj3
    its own group, reshard_after_forward=False) directly; torch's backward then
    raises setStorage (a torch-only repro with the backward shows it). Spec
    source 004 promises gradients only through a parameter's own module's
    forward: FWD-PARITY already treated it as not promised, FSDP2-FROZEN
    reported it as FAIL. Both must agree: not checked, with the reason."""
    from conformance.case.spec import ClassSpec, ModuleSpec, ParamSpec, SharedModule, WrapPlan
    from conformance.run.runner import UNCHECKED, check_case

    lin = [ModuleSpec(f"proj{i}", "Linear", params=(ParamSpec("weight", (1, 1), False),)) for i in range(4)]
    lin[0] = ModuleSpec("proj0", "Linear", params=(ParamSpec("weight", (1, 1), False), ParamSpec("bias", (1,), True)))
    spec = CaseSpec(
        tree=ModuleSpec("", "Model", params=(ParamSpec("scale", (1,), False),), children=tuple(lin)),
        classes=(ClassSpec("Model", "Module"),), shared=(SharedModule("", "shared0", "proj0"),),
        plan=WrapPlan("fsdp2", groups=(ShardGroup(("proj3",), reshard_after_forward=False),)),
        methods=(ForwardMethod("", "generate", (MethodStep("forward", ""), MethodStep("param", "proj3.weight")), register=True),),
        calls=(MethodCall(-1, 1), MethodCall(0, 3)),
    )
    assert not predict_fsdp2(spec, "2.13.0").backward_promised
    for inv in ("FSDP2-FROZEN", "FWD-PARITY"):
        res = check_case(inv, spec, fake_engine)
        assert res.verdict == UNCHECKED, res.describe()


def test_a_list_group_rerun_is_tagged_for_its_findings():
    """Seed 21's case: fully_shard([proj0, model1]) with proj0 also registered
    as shared0 (it runs again after model1 completed the group): tagged
    group:rerun under gradient accumulation (fsdp2-list-group-rerun-reduces-
    twice); without the second name, or with every microbatch synced, not."""
    import json

    from conformance.areas.schedule.invariants import case_tags
    from conformance.areas.schedule.oracle import predict_schedule
    from conformance.case.spec import CaseSpec, SharedModule

    spec = CaseSpec.from_json(json.dumps({"case": json.loads(SEED21), "version": 1}))
    assert "group:rerun" in case_tags(spec, predict_schedule(spec))
    plain = dataclasses.replace(spec, shared=())
    assert "group:rerun" not in case_tags(plain, predict_schedule(plain))
    steps = tuple(dataclasses.replace(st, sync_every=True) for st in spec.schedule.steps)
    synced = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, steps=steps))
    assert "group:rerun" not in case_tags(synced, predict_schedule(synced))
    assert spec.shared == (SharedModule("", "shared0", "proj0"),)


SEED21 = r'''
{"activation_checkpoint": null, "calls": [], "ckpt": null, "classes": [{"base": "Module", "name": "Model", "type": "ClassSpec"}], "clip": null, "comm": null, "hsdp": null, "init": null, "methods": [], "microbatch": null, "plan": {"api": "fsdp2", "groups": [{"modules": ["proj0", "model1"], "reshard_after_forward": null, "type": "ShardGroup"}], "ignored_modules": [], "ignored_params": [], "policy": null, "type": "WrapPlan", "use_orig_params": false}, "schedule": {"first": -1, "lr": 0.05, "optimizer": "SGD", "precision": {"buffer_dtype": null, "cast_forward_inputs": null, "cast_root_forward_inputs": true, "keep_low_precision_grads": false, "output_dtype": null, "param_dtype": "bfloat16", "reduce_dtype": null, "type": "Precision"}, "steps": [{"frozen": [], "microbatches": [{"skip": [], "type": "Microbatch"}, {"skip": [], "type": "Microbatch"}], "sync_every": false, "type": "ScheduleStep"}], "type": "Schedule"}, "seed": 0, "shared": [{"name": "shared0", "parent": "", "source": "proj0", "type": "SharedModule"}], "ties": [{"module": "model1", "name": "tied0", "source": "proj0.weight", "type": "TiedParam"}], "tp": null, "train": null, "tree": {"buffers": [], "children": [{"buffers": [], "children": [], "cls": "Linear", "name": "proj0", "params": [{"name": "weight", "requires_grad": true, "shape": [1, 1], "type": "ParamSpec"}], "type": "ModuleSpec"}, {"buffers": [], "children": [{"buffers": [], "children": [], "cls": "Linear", "name": "proj0", "params": [{"name": "weight", "requires_grad": true, "shape": [1, 1], "type": "ParamSpec"}], "type": "ModuleSpec"}], "cls": "Model", "name": "model1", "params": [], "type": "ModuleSpec"}], "cls": "Model", "name": "", "params": [], "type": "ModuleSpec"}, "type": "CaseSpec"}
'''


def test_the_rerun_finding_takes_a_rounding_not_a_wrong_value():
    """fsdp2-list-group-rerun-reduces-twice moves a gradient by one rounding
    of reduce_dtype: its MP-PIPELINE match needs off:rounding, so a wrong
    value in the same structure stays a FAIL."""
    from conformance.case.violation import Violation
    from conformance.run import known

    base = {"api:fsdp2", "group:rerun", "no-sync", "kind:grad"}
    rounding = known.match(Violation("MP-PIPELINE", "m", frozenset(base | {"off:rounding"})), known.load(), "2.13.0")
    assert rounding is not None and rounding.id == "fsdp2-list-group-rerun-reduces-twice"
    assert known.match(Violation("MP-PIPELINE", "m", frozenset(base | {"off:large"})), known.load(), "2.13.0") is None
