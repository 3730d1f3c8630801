"""FROZEN-ERROR / FROZEN-WARN catch a frozen-parameter check that meets the
units in the wrong order (issue 10's traversal-order mutant, monkeypatched
here): reversed named_modules() instead of the named_children DFS. Without
shared modules this is a FAIL, never the known shared-module-order finding."""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import _wrap_utils

from conformance.runner import FAIL, PASS, evaluate, observations
from conformance.spec import CaseSpec, ClassSpec, ModuleSpec, ModuleWrap, ParamSpec, WrapPlan

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
