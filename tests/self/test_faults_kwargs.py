"""WRAP-KWARGS catches a CustomPolicy that drops the kwargs its lambda
returns (the mutant fsdp1-custom-policy-kwargs-dropped, monkeypatched
here)."""

from __future__ import annotations

import copy

import pytest
from torch.distributed.fsdp.wrap import CustomPolicy

from conformance.case.spec import CaseSpec, ClassSpec, CustomWrap, ModuleSpec, ParamSpec, SharedModule, WrapPlan
from conformance.run.runner import FAIL, PASS, evaluate, observations

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]


def custom_kwargs_case() -> CaseSpec:
    def linear(name):
        return ModuleSpec(name, "Linear", (ParamSpec("weight", (2, 2), True), ParamSpec("bias", (2,), True)), (), ())

    tree = ModuleSpec("", "ModelSeq", (), (), (linear("0"), linear("1")))
    policy = CustomWrap(targets=("0", "1"), kwargs=(("0", (("sharding_strategy", "SHARD_GRAD_OP"),)), ("1", (("forward_prefetch", True),))))
    return CaseSpec(tree=tree, classes=(ClassSpec("ModelSeq", "Sequential"),), plan=WrapPlan(api="fsdp1", policy=policy), seed=0)


def _dropping_kwargs(orig):
    def run_policy(self, root_module, ignored_modules, root_kwargs):
        targets = orig(self, root_module, ignored_modules, root_kwargs)
        return {m: copy.copy(root_kwargs) for m in targets}

    return run_policy


def test_wrap_kwargs_catches_dropped_custom_kwargs(fake_engine, monkeypatch):
    spec = custom_kwargs_case()
    clean = evaluate("WRAP-KWARGS", spec, observations(fake_engine, spec))
    assert clean.verdict == PASS, clean.describe()
    monkeypatch.setattr(CustomPolicy, "_run_policy", _dropping_kwargs(CustomPolicy._run_policy))
    res = evaluate("WRAP-KWARGS", spec, observations(fake_engine, spec))
    assert res.verdict == FAIL, res.describe()
    msgs = " ".join(v.message for v in res.violations)
    assert "unit 0 was built with sharding_strategy='FULL_SHARD' (expected 'SHARD_GRAD_OP')" in msgs
    assert "unit 1 was built with forward_prefetch=False (expected True)" in msgs


def shared_target_case() -> CaseSpec:
    """model1 is also registered as model0.shared0, so FSDP reports its unit
    under that first name; the plan targets it as model1 with SHARD_GRAD_OP
    (the corpus case suite-wrap-kwargs-shared-module-path)."""
    leaf = lambda name: ModuleSpec(name, "Model", (ParamSpec("weight", (3,), True),), (), ())  # noqa: E731
    tree = ModuleSpec("", "Model", (), (), (leaf("model0"), leaf("model1")))
    policy = CustomWrap(targets=("model1",), kwargs=(("model1", (("sharding_strategy", "SHARD_GRAD_OP"),)),))
    return CaseSpec(
        tree=tree,
        classes=(ClassSpec("Model", "Module"),),
        shared=(SharedModule(parent="model0", name="shared0", source="model1"),),
        plan=WrapPlan(api="fsdp1", policy=policy),
        seed=0,
    )


def test_wrap_kwargs_follows_a_shared_module_to_the_name_its_unit_has(fake_engine, monkeypatch):
    """A suite bug seen on the 2.14.1 baseline: the expected kwargs were looked
    up by the unit's reported path, so a shared module's own kwargs were
    expected to be the root's. Keyed by module, the clean case passes and the
    dropped-kwargs regression is still caught under the other name."""
    spec = shared_target_case()
    obs = observations(fake_engine, spec)
    assert "model0.shared0" in {u.path for u in obs[0].units}, "the case no longer reports the shared unit under its first name"
    clean = evaluate("WRAP-KWARGS", spec, obs)
    assert clean.verdict == PASS, clean.describe()
    monkeypatch.setattr(CustomPolicy, "_run_policy", _dropping_kwargs(CustomPolicy._run_policy))
    res = evaluate("WRAP-KWARGS", spec, observations(fake_engine, spec))
    assert res.verdict == FAIL, res.describe()
    assert "unit model0.shared0 was built with sharding_strategy='FULL_SHARD' (expected 'SHARD_GRAD_OP')" in " ".join(v.message for v in res.violations)
