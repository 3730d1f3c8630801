"""FSDP1 units that are torch's Sequential are in the training areas' reach.

A user's model calls an ``nn.Sequential`` (FSDP1 then unshards the unit in
its forward); it only iterates a ModuleList or ModuleDict. The case's
forward does the same (conformance.case.build.call_child), so the training
strategies draw FSDP1 cases whose size-based or class-based policy wraps a
Sequential, the training oracle promises their training, and the comm
oracle (COMM-FSDP1-*, AC-ALLGATHER) enters and exits them like any called
module. The summon strategy leaves them out: its methods call the root's
children inside summon_full_params.

Spec: the FullyShardedDataParallel docstring (a wrapped module's forward
all-gathers its parameters); size_based_auto_wrap_policy excludes
ModuleList and ModuleDict, not Sequential, from wrapping.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from conformance.areas.common.comm_oracle import timeline
from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.areas.common.training_oracle import predict_training
from conformance.areas.parity.observation import TrainObservation
from conformance.case.graph import ModelGraph
from conformance.case.spec import CaseSpec, ClassSpec, CustomWrap, ModuleSpec, ParamSpec, SizeBasedWrap, TrainPlan, WrapPlan
from conformance.run.runner import FAIL, PASS, evaluate, observations
from conformance.strategies.comm import comm_specs
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


def container_units(spec: CaseSpec) -> set[str]:
    g = ModelGraph(spec)
    return {k for u in predict_fsdp1(spec).units for k in ("Sequential", "ModuleList", "ModuleDict")
            if g.is_torch(g.resolve_module(u.path), (k,), exact=True)}


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
    # FSDP2 never calls it (fully_shard is not given torch's containers)
    fsdp2 = dataclasses.replace(spec, plan=WrapPlan(api="fsdp2"))
    assert "body" not in {s.path for s in timeline(fsdp2, frozenset({"scale"}))[0]}


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(2)


def run(spec: CaseSpec, engine, scenario: str = "train"):
    return evaluate("PARITY", spec, observations(engine, spec, scenario, TrainObservation.from_dict))


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
