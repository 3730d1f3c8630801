"""WRAP-KWARGS catches a CustomPolicy that drops the kwargs its lambda
returns (issue 10's mutant fsdp1-custom-policy-kwargs-dropped, monkeypatched
here)."""

from __future__ import annotations

import copy

import pytest
from torch.distributed.fsdp.wrap import CustomPolicy

from conformance.runner import FAIL, PASS, evaluate, observations
from conformance.spec import CaseSpec, ClassSpec, CustomWrap, ModuleSpec, ParamSpec, WrapPlan

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
