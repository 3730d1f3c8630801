"""FROZEN-ERROR / FROZEN-WARN catch a frozen-parameter check that meets the
units in the wrong order (the traversal-order mutant, monkeypatched
here): reversed named_modules() instead of the named_children DFS. Without
shared modules this is a FAIL, never the known shared-module-order finding."""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import _wrap_utils

from conformance.case.spec import CaseSpec, ClassSpec, CustomWrap, ModuleSpec, ModuleWrap, ParamSpec, SharedModule, WrapPlan
from conformance.run.runner import FAIL, KNOWN, PASS, evaluate, observations

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]


def two_mixed_siblings(use_orig_params: bool) -> CaseSpec:
    def linear(name):
        return ModuleSpec(name, "Linear", (ParamSpec("weight", (2, 2), False), ParamSpec("bias", (2,), True)), (), ())

    tree = ModuleSpec("", "ModelSeq", (), (), (linear("0"), linear("1")))
    plan = WrapPlan(api="fsdp1", policy=ModuleWrap(classes=("Linear",)), use_orig_params=use_orig_params)
    return CaseSpec(tree=tree, classes=(ClassSpec("ModelSeq", "Sequential"),), plan=plan, seed=0)


def _reversed_named_modules(root_module):
    return list(reversed(list(root_module.named_modules())))


@pytest.mark.parametrize("invariant, uop, kind", [("FROZEN-ERROR", False, "kind:wrong-module"), ("FROZEN-WARN", True, "kind:order")])
def test_frozen_check_in_the_wrong_order_fails(invariant, uop, kind, fake_engine, monkeypatch):
    spec = two_mixed_siblings(uop)
    clean = evaluate(invariant, spec, observations(fake_engine, spec))
    assert clean.verdict == PASS, clean.describe()
    monkeypatch.setattr(_wrap_utils, "_get_post_order_named_modules", _reversed_named_modules)
    res = evaluate(invariant, spec, observations(fake_engine, spec))
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags and "order:shared-subtree" not in v.tags for v in res.violations), res.describe()


def shared_unit_under_a_unit() -> CaseSpec:
    """CustomWrap targets model1 and model2.lora0, model2 also registered
    under model1 (first there): lora0 (frozen) is its own unit, model1
    (trainable) is uniform, the root mixes head (trainable) and tail
    (frozen). torch's frozen check visits lora0 at its last registration,
    after simulating model1, whose walk then claims lora0's parameters."""
    def linear(name, trainable):
        return ModuleSpec(name, "Linear", (ParamSpec("weight", (2, 2), trainable),), (), ())

    tree = ModuleSpec("", "Model", (), (), (
        ModuleSpec("model1", "Block", (), (), (linear("proj0", True),)),
        ModuleSpec("model2", "Block", (), (), (linear("lora0", False),)),
        linear("head", True),
        linear("tail", False),
    ))
    plan = WrapPlan(api="fsdp1", policy=CustomWrap(("model1", "model2.lora0")), use_orig_params=False)
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), shared=(SharedModule("model1", "shared0", "model2"),),
                    plan=plan, seed=0)


def test_shared_unit_claimed_by_an_earlier_unit_is_the_known_finding(fake_engine):
    """The oracle names the root (the only unit that mixes after wrapping);
    torch names model1: the known shared-module-order finding, matched by
    the sim:claims-shared-unit tag, which only a unit above an earlier
    registration of a shared unit gets."""
    from conformance.areas.autowrap.invariants import _claims_shared_unit
    from conformance.areas.common.fsdp1_oracle import predict_fsdp1

    spec = shared_unit_under_a_unit()
    pred = predict_fsdp1(spec)
    assert pred.error is not None and pred.error.path == ""
    assert _claims_shared_unit(spec, pred.units, "model1")
    assert not any(_claims_shared_unit(spec, pred.units, p) for p in ("", "model2", "head", "model1.proj0"))
    res = evaluate("FROZEN-ERROR", spec, observations(fake_engine, spec))
    assert res.verdict == KNOWN, res.describe()
    [(v, fid)] = res.known
    assert fid == "fsdp1-frozen-check-shared-module-order"
    assert "names module model1, expected <root>" in v.message and {"sim:claims-shared-unit", "names:aliased"} <= v.tags
