"""torch's Sequential as an FSDP1 unit or given to fully_shard is in reach.

A user's model calls an ``nn.Sequential`` (FSDP1's wrapper, or FSDP2's
hooks on it, then unshard it in its forward); it only iterates a ModuleList
or ModuleDict. The case's forward does the same
(conformance.case.build.call_child), so the FSDP1 training strategies draw
cases whose size-based or class-based policy wraps a Sequential, the FSDP2
strategies give fully_shard a Sequential, the training and FSDP2 oracles
promise them, and the comm oracle (COMM-*, AC-ALLGATHER) enters and exits
them like any called module. The summon strategy leaves FSDP1's out: its
methods call the root's children inside summon_full_params.

Spec: the FullyShardedDataParallel docstring (a wrapped module's forward
all-gathers its parameters); size_based_auto_wrap_policy excludes
ModuleList and ModuleDict, not Sequential, from wrapping; the fully_shard
docstring (the module's forward hooks all-gather its parameters).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from conformance.areas.common.comm_oracle import timeline
from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.areas.common.fsdp2_oracle import forward_calls, predict_fsdp2
from conformance.areas.common.training_oracle import predict_training
from conformance.areas.parity.observation import TrainObservation
from conformance.case.graph import ModelGraph
from conformance.case.spec import CaseSpec, ClassSpec, CustomWrap, ModuleSpec, ParamSpec, ShardGroup, SizeBasedWrap, TrainPlan, WrapPlan
from conformance.run.runner import FAIL, PASS, evaluate, observations
from conformance.strategies.comm import comm_specs
from conformance.strategies.groups import fsdp2_case_specs
from conformance.strategies.training import fsdp1_trainable, training_specs
from tests.self import faults_fsdp2  # noqa: F401  (registers the fault scenarios in the driver)

pytestmark = pytest.mark.selfcheck


def _linear(name: str, rows: int = 3) -> ModuleSpec:
    return ModuleSpec(name, "Linear", (ParamSpec("weight", (rows, 3)), ParamSpec("bias", (rows,))))


def model(container: str = "Sequential", *, uop: bool = False, policy=None) -> CaseSpec:
    """root (scale) -> body (a torch ``container`` of two Linears, its own
    FSDP1 unit) -> head (Linear 4x3, uneven over two ranks)."""
    names = ("0", "1") if container != "ModuleDict" else ("a", "b")
    body = ModuleSpec("body", container, (), children=tuple(_linear(n) for n in names))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(body, _linear("head", 4)))
    plan = WrapPlan(api="fsdp1", policy=policy or CustomWrap(("body",)), use_orig_params=uop)
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"),), plan=plan, train=TrainPlan("SGD", 2, 0.05), seed=11)


def fsdp2(spec: CaseSpec) -> CaseSpec:
    """The same model, body given to fully_shard (the root too)."""
    return dataclasses.replace(spec, plan=WrapPlan(api="fsdp2", groups=(ShardGroup(("body",)),)))


def container_units(spec: CaseSpec) -> set[str]:
    """The torch containers among the case's FSDP1 units or FSDP2 groups' modules."""
    g = ModelGraph(spec)
    if spec.plan.api == "fsdp2":
        paths = [m for grp in spec.plan.groups for m in grp.modules]
    else:
        paths = [u.path for u in predict_fsdp1(spec).units]
    return {k for p in paths for k in ("Sequential", "ModuleList", "ModuleDict") if g.is_torch(g.resolve_module(p), (k,), exact=True)}


def test_a_sequential_unit_is_trainable_an_iterated_container_is_not():
    seq = model()
    assert container_units(seq) == {"Sequential"}
    assert fsdp1_trainable(seq)
    assert predict_training(seq).applicable == ""
    assert not fsdp1_trainable(seq, sequential_units=False)  # summon
    for kind in ("ModuleList", "ModuleDict"):
        spec = model(kind)
        assert container_units(spec) == {kind}
        assert not fsdp1_trainable(spec) and not fsdp1_trainable(spec, sequential_units=False)
        pred = predict_training(spec)
        assert pred.rule == "container-unit" and kind in pred.applicable, pred


def test_fully_shard_on_a_sequential_is_promised_on_an_iterated_container_not():
    seq = fsdp2(model())
    assert container_units(seq) == {"Sequential"}
    assert predict_fsdp2(seq, "2.13.0").supported == "" and predict_training(seq).applicable == ""
    assert "body" in forward_calls(seq)  # its forward runs, so its hooks do
    assert "body" not in forward_calls(model())  # under FSDP1 no FSDP2 hook is there to run
    for kind in ("ModuleList", "ModuleDict"):
        spec = fsdp2(model(kind))
        assert "a model iterates it" in predict_fsdp2(spec, "2.13.0").supported
        assert "body" not in forward_calls(spec)


def test_a_size_based_policy_wraps_the_sequential():
    """The common way a Sequential becomes a unit: its Linears hold enough
    parameters for size_based_auto_wrap_policy."""
    spec = model(policy=SizeBasedWrap(20))
    assert "body" in {u.path for u in predict_fsdp1(spec).units}
    assert fsdp1_trainable(spec) and predict_training(spec).applicable == ""


def test_the_training_strategy_draws_sequential_units():
    found = find(training_specs(api="fsdp1"), lambda s: "Sequential" in container_units(s),
                 settings=settings(max_examples=2000, database=None, phases=[Phase.generate],
                                   suppress_health_check=list(HealthCheck)))
    assert fsdp1_trainable(found)


def test_the_fsdp2_strategy_gives_fully_shard_sequentials():
    find(fsdp2_case_specs(), lambda s: "Sequential" in container_units(s),
         settings=settings(max_examples=2000, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck)))


@settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=fsdp2_case_specs())
def test_the_fsdp2_strategy_gives_fully_shard_no_iterated_container(spec):
    assert not container_units(spec) & {"ModuleList", "ModuleDict"}


@settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=training_specs(api="fsdp1"))
def test_the_training_strategy_draws_no_iterated_container_unit(spec):
    assert not container_units(spec) & {"ModuleList", "ModuleDict"}


@settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=comm_specs(api="fsdp1"))
def test_the_comm_strategy_draws_no_iterated_container_unit(spec):
    assert not container_units(spec) & {"ModuleList", "ModuleDict"}


def test_the_comm_timeline_enters_a_sequential_unit_and_walks_other_containers():
    spec = model()
    steps, _ = timeline(spec, frozenset({"scale", "body.0.weight"}))
    assert [(s.kind, s.path) for s in steps if s.path == "body"] == [("enter", "body"), ("exit", "body")]
    for kind in ("ModuleList", "ModuleDict"):
        steps, _ = timeline(model(kind), frozenset({"scale"}))
        assert "body" not in {s.path for s in steps}
    # FSDP2: called where it is given to fully_shard, else walked
    steps, _ = timeline(fsdp2(spec), frozenset({"scale"}))
    assert [(s.kind, s.path) for s in steps if s.path == "body"] == [("enter", "body"), ("exit", "body")]
    root_only = dataclasses.replace(spec, plan=WrapPlan(api="fsdp2"))
    assert "body" not in {s.path for s in timeline(root_only, frozenset({"scale"}))[0]}


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(2)


def run(spec: CaseSpec, engine, scenario: str = "train"):
    return evaluate("PARITY", spec, observations(engine, spec, scenario, TrainObservation.from_dict))


@pytest.mark.gloo
def test_a_sequential_given_to_fully_shard_trains_as_the_unsharded_model_and_a_skipped_unshard_is_caught(pool):
    spec = fsdp2(model())
    assert run(spec, pool).verdict == PASS
    res = run(spec, pool, "fault:train:fsdp2-sequential-group-not-unsharded")
    assert res.verdict == FAIL, res.describe()
    other = dataclasses.replace(spec, plan=WrapPlan(api="fsdp2", groups=(ShardGroup(("head",)),)))
    assert run(other, pool, "fault:train:fsdp2-sequential-group-not-unsharded").verdict == PASS


@pytest.mark.gloo
@pytest.mark.parametrize("uop", [False, True], ids=["flat", "orig-params"])
def test_a_sequential_unit_trains_as_the_unsharded_model_and_a_skipped_unshard_is_caught(uop, pool):
    spec = model(uop=uop)
    res = run(spec, pool)
    assert res.verdict == PASS, res.describe()  # PASS: values compared (else UNCHECKED)
    res = run(spec, pool, "fault:train:fsdp1-sequential-unit-not-unsharded")
    assert res.verdict == FAIL, res.describe()
    # the other units are unsharded as before: the fault is the Sequential's
    other = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, policy=CustomWrap(("head",))))
    assert run(other, pool, "fault:train:fsdp1-sequential-unit-not-unsharded").verdict == PASS
