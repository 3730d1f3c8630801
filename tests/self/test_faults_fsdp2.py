"""Every FSDP2, forward-method and PARITY invariant catches a fault injected
into FSDP2, into register_fsdp_forward_method or into FSDP1's summon.

Each test shows the hand-written case holds on unmodified torch, then injects
one plausible regression and shows the invariant turns it into a FAIL with
the expected kind. Structural faults run in-process on the fake tier (a
monkeypatch reaches it); faults that only values show run inside the ranks of
a gloo pool through test-only scenarios (tests/self/faults_fsdp2.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from conformance.areas.fully_shard.observation import FSDP2Observation
from conformance.areas.parity.observation import TrainObservation
from conformance.case.spec import (
    CaseSpec,
    ClassSpec,
    CustomWrap,
    ForwardMethod,
    MethodCall,
    MethodStep,
    ModuleSpec,
    ParamSpec,
    ShardGroup,
    TiedParam,
    TrainPlan,
    WrapPlan,
)
from conformance.run.runner import FAIL, PASS, evaluate, observations
from tests.self import faults_fsdp2 as faults

pytestmark = pytest.mark.selfcheck

SCENARIO = {"fsdp2": ("fsdp2", FSDP2Observation.from_dict), "fsdp1-methods": ("fsdp1-methods", FSDP2Observation.from_dict), "train": ("train", TrainObservation.from_dict)}
KIND = {"FWD-SUMMON": "fsdp1-methods", "PARITY": "train"}


def lm(*, groups=(ShardGroup(("block",), True),), methods=None, calls=None, api="fsdp2", policy=None, train=None, uop=False,
       ignored=()) -> CaseSpec:
    """An LM-like model: embed, block (a Block with proj0 and a frozen bias),
    note (a Block outside any group), head tied to embed.weight; generate()
    on the root reads the tied weight through F.linear and calls block;
    forward_features() on block reads its parameters directly."""
    block = ModuleSpec("block", "Block", (ParamSpec("w", (3,)),), children=(
        ModuleSpec("proj0", "Linear", (ParamSpec("weight", (3, 3)), ParamSpec("bias", (3,), False))),
    ))
    note = ModuleSpec("note", "Block", (ParamSpec("w", (3,)),))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(
        ModuleSpec("embed", "Embedding", (ParamSpec("weight", (4, 3)),)), block, note,
        ModuleSpec("head", "Linear", (ParamSpec("weight", (4, 3)),)),
    ))
    if methods is None:
        methods = (
            ForwardMethod("", "generate", (MethodStep("param", "embed.weight"), MethodStep("child", "block"))),
            ForwardMethod("block", "forward_features", (MethodStep("param", "proj0.weight"), MethodStep("param", "w"))),
            ForwardMethod("note", "score", (MethodStep("param", "w"),)),
        )
    if calls is None:
        calls = (MethodCall(-1), MethodCall(0, 2, True), MethodCall(1, 1, True), MethodCall(2))
    plan = WrapPlan(api="fsdp2", groups=groups, ignored_params=ignored) if api == "fsdp2" else WrapPlan(api="fsdp1", policy=policy, use_orig_params=uop)
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), ties=(TiedParam("head", "weight", "embed.weight"),),
                    plan=plan, methods=methods, calls=calls, train=train, seed=3)


def run(invariant, spec, engine, scenario=None):
    kind = KIND.get(invariant, "fsdp2")
    name, parse = SCENARIO[kind]
    return evaluate(invariant, spec, observations(engine, spec, scenario or name, parse))


def assert_holds(invariant, spec, engine):
    res = run(invariant, spec, engine)
    assert res.verdict == PASS, res.describe()


def assert_caught(res, kind):
    kinds = (kind,) if isinstance(kind, str) else kind
    assert res.verdict == FAIL, res.describe()
    assert any(k in v.tags for v in res.violations for k in kinds), res.describe()


# ---- in-process, fake tier ------------------------------------------------------

STRUCTURAL = [
    ("FSDP2-GROUPS", "managed-states-drop-last", "kind:managed", {}),
    ("FSDP2-GROUPS", "ignored-params-managed", "kind:managed", {"ignored": ("block.proj0.weight", "scale")}),
    ("FSDP2-FROZEN", "frozen-made-trainable", "kind:frozen-grad", {}),
    ("FSDP2-TIES", "no-duplicate-check", "kind:duplicated", {"groups": (ShardGroup(("embed",), True),)}),
    ("FWD-ALLGATHER", "register-without-hooks", "kind:entry-sharded", {}),
    ("FWD-RESHARD", "never-reshard", "kind:not-resharded", {}),
    # a list group that generate() (after a forward, before backward) runs in part
    ("FWD-RESHARD", "post-forward-state-not-reset", "kind:not-resharded",
     {"groups": (ShardGroup(("block", "note"), True),), "calls": (MethodCall(-1), MethodCall(0))}),
    ("FWD-NOOP", "register-non-fsdp-too", "kind:patched", {}),
    ("FWD-MISSING", "register-ignores-missing", "kind:no-error", {}),
    ("FWD-NESTED", "nested-groups-stay-sharded", "kind:raised", {}),
    ("FWD-ISOLATION", "register-on-class", "kind:leaked", {}),
    ("FWD-ISOLATION", "register-on-fsdp-class", "kind:leaked", {}),  # with siblings(): see below
]


def siblings() -> CaseSpec:
    """block and note: two Blocks, each its own group; forward_features
    registered on block only, and note's (not registered, empty body) called
    after it: note's method must run without FSDP's hooks and give the
    reference's output."""
    methods = (
        ForwardMethod("block", "forward_features", (MethodStep("param", "proj0.weight"), MethodStep("param", "w"))),
        ForwardMethod("note", "forward_features", (), register=False),
    )
    groups = (ShardGroup(("block",), True), ShardGroup(("note",), True))
    return lm(groups=groups, methods=methods, calls=(MethodCall(-1), MethodCall(0), MethodCall(1, 2, True)))


@pytest.mark.fake
@pytest.mark.parametrize("invariant,fault,kind,changes", STRUCTURAL, ids=[f"{s[0]}-{s[1]}" for s in STRUCTURAL])
def test_structural_fault_is_caught(invariant, fault, kind, changes, fake_engine):
    if "ignored" in changes:
        from conformance.areas.common.fsdp2_adapter import takes_ignored_params

        if not takes_ignored_params():
            pytest.skip("this torch's fully_shard takes no ignored_params")
    spec = siblings() if fault == "register-on-fsdp-class" else lm(**changes)
    if invariant == "FSDP2-TIES":
        # torch >= 2.13 rejects this tie at the first forward: the case holds
        # (an error naming it); without the check the tie is duplicated
        assert run(invariant, spec, fake_engine).verdict == PASS
    else:
        assert_holds(invariant, spec, fake_engine)
    with faults.FAULTS[fault]():
        assert_caught(run(invariant, spec, fake_engine), kind)


@pytest.mark.fake
@pytest.mark.parametrize("case", ["drawn", "model"])
def test_the_bench_s_fsdp_time_is_fsdp_s_work_not_the_reference_s_or_the_observation_s(case, fake_engine, monkeypatch):
    """What the bench counts as a fully_shard example's FSDP time
    (obs.seconds + backward_seconds): fully_shard, registration, the calls
    and backward; not the unsharded reference's calls or the suite's reading
    of the groups' states and outputs after each call. Each of those moves
    the Stopwatch's clock on by SLOW (no real sleep: a loaded machine's FSDP
    time cannot reach SLOW, a slowed step timed by mistake always does)."""
    import time
    import types

    from conformance.areas.common import timing
    from conformance.areas.common.fsdp2_adapter import fsdp2_api
    from conformance.areas.fully_shard import adapter
    from conformance.case.model_case import ModelCase

    SLOW = 1000.0
    FSDPModule = fsdp2_api()[1]
    real_states, real_callable, real_shard = adapter._group_states, adapter.method_callable, adapter.shard
    skipped = []

    def nap():
        skipped.append(SLOW)

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + sum(skipped)))

    def slow_states(*a):
        nap()
        return real_states(*a)

    def slow_reference(model, spec, index):
        fn = real_callable(model, spec, index)
        if isinstance(model, FSDPModule):
            return fn

        def call(*a, **k):
            nap()
            return fn(*a, **k)

        return call

    def slow_compare(*a):
        nap()
        return real_compare(*a)

    spec = lm() if case == "drawn" else ModelCase("conformance.models.toy_target:target", plan=WrapPlan(api="fsdp2"))
    fake_engine.run("fsdp2", spec)  # the process's first fully_shard imports what it needs (a quarter second)
    real_compare = adapter.compare
    monkeypatch.setattr(adapter, "_group_states", slow_states)
    monkeypatch.setattr(adapter, "method_callable", slow_reference)
    monkeypatch.setattr(adapter, "compare", slow_compare)
    obs = fake_engine.run("fsdp2", spec)[0]["value"]
    assert obs["calls"] and not any(c["error"] for c in obs["calls"]), obs["calls"]
    assert len(skipped) >= 2 and obs["seconds"] + obs["backward_seconds"] < SLOW, (obs["seconds"], len(skipped))
    # and fully_shard's own time is counted
    monkeypatch.setattr(adapter, "shard", lambda *a: (nap(), real_shard(*a))[1])
    assert fake_engine.run("fsdp2", spec)[0]["value"]["seconds"] >= SLOW


# ---- inside the ranks of a gloo pool (values) -------------------------------------


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(2)


def summon_case() -> CaseSpec:
    generate = ForwardMethod("", "generate", (MethodStep("param", "embed.weight"), MethodStep("param", "scale")))
    return lm(api="fsdp1", policy=CustomWrap(("block",)), uop=True, methods=(generate,), calls=(MethodCall(-1), MethodCall(0, 2, True)))


VALUES = [
    ("FWD-SUMMON", "summon-does-nothing", ("kind:output", "kind:raised"), summon_case),
    ("FWD-PARITY", "register-drops-kwargs", "kind:output", lambda: lm()),
    ("FWD-ISOLATION", "register-on-fsdp-class", "kind:leaked-output", siblings),
    ("PARITY", "gradients-doubled", "kind:param", lambda: dataclasses.replace(lm(), methods=(), calls=(), train=TrainPlan("SGD", 2))),
    ("PARITY", "sum-reduction-not-divided", "kind:param", lambda: dataclasses.replace(
        lm(), methods=(), calls=(), train=TrainPlan("SGD", 2, force_sum=True))),
    ("PARITY", "sum-reduction-not-divided", "kind:param", lambda: dataclasses.replace(
        lm(), methods=(), calls=(), train=TrainPlan("SGD", 2, force_sum=True, divide_factor=3.0))),
    ("PARITY", "frozen-made-trainable", ("kind:frozen-grad", "kind:frozen-changed"), lambda: dataclasses.replace(lm(), methods=(), calls=(), train=TrainPlan("Adam", 2))),
]


@pytest.mark.gloo
@pytest.mark.parametrize("invariant,fault,kind,make", VALUES, ids=[f"{v[0]}-{v[1]}" for v in VALUES])
def test_value_fault_is_caught_inside_the_ranks(invariant, fault, kind, make, pool):
    spec = make()
    if spec.train is not None and spec.train.force_sum:
        from conformance.areas.common.fsdp2_adapter import has_reduction_setters

        if not has_reduction_setters():
            pytest.skip("this torch's FSDPModule has no set_force_sum_reduction_for_comms")
    assert_holds(invariant, spec, pool)
    scenario = f"fault:{KIND.get(invariant, 'fsdp2')}:{fault}"
    res = run(invariant, spec, pool, scenario)
    assert_caught(res, kind)
    if invariant != "FWD-SUMMON":  # the value-comparing invariants name the backend (tests/self/test_known_backend.py)
        assert all("backend:gloo" in v.tags for v in res.violations), res.describe()


@pytest.mark.gloo
@pytest.mark.parametrize("invariant", ["FSDP2-FROZEN", "FWD-PARITY"])
def test_a_raise_reading_the_full_values_after_backward_is_the_invariants_verdict(invariant, pool):
    """The read of every parameter's and gradient's full value after the
    backward (DTensor.full_tensor) raising is FSDP2-FROZEN's and FWD-PARITY's
    FAIL (kind:raised, at:read), not the scenario's own error, which named no
    invariant."""
    spec = lm(methods=(ForwardMethod("block", "forward_features", (MethodStep("child", "proj0"),)),), calls=(MethodCall(-1), MethodCall(0)))
    assert_holds(invariant, spec, pool)
    res = run(invariant, spec, pool, "fault:fsdp2:full-tensor-raises")
    assert_caught(res, "at:read")
    assert all({"kind:raised", "raised:RuntimeError"} <= v.tags for v in res.violations), res.describe()
