"""Small hand-written CaseSpecs for the suite's own tests."""

from __future__ import annotations

import dataclasses

from conformance.case.spec import CaseSpec, ClassSpec, ModuleSpec, ModuleWrap, ParamSpec, TiedParam, WrapPlan

CLASSES = (ClassSpec("M"), ClassSpec("A"), ClassSpec("B", "A"))


def linear(name: str, n_in: int = 3, n_out: int = 3, trainable: bool = True, bias: bool = True) -> ModuleSpec:
    ps = (ParamSpec("weight", (n_out, n_in), trainable),)
    if bias:
        ps += (ParamSpec("bias", (n_out,), trainable),)
    return ModuleSpec(name, "Linear", ps)


def with_plan(spec: CaseSpec, **changes) -> CaseSpec:
    return dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, **changes))


def two_blocks(*, use_orig_params: bool = False, frozen_b: bool = False) -> CaseSpec:
    """M(a: A(l), b: B(l), z) wrapped by class A (B derives from A)."""
    return CaseSpec(
        tree=ModuleSpec(
            "",
            "M",
            params=(ParamSpec("scale", (2,)),),
            children=(
                ModuleSpec("a", "A", children=(linear("l"),)),
                ModuleSpec("b", "B", children=(linear("l", trainable=not frozen_b),)),
                linear("z", 2, 2),
            ),
        ),
        classes=CLASSES,
        plan=WrapPlan(policy=ModuleWrap(("A",)), use_orig_params=use_orig_params),
    )


def sibling_tie(*, use_orig_params: bool = False) -> CaseSpec:
    """b.l.weight is a.l.weight; a and b are separate units."""
    spec = two_blocks(use_orig_params=use_orig_params)
    return dataclasses.replace(spec, ties=(TiedParam("b.l", "weight", "a.l.weight"),))


def uniform_mixed_units(*, use_orig_params: bool) -> CaseSpec:
    """Two units that each mix requires_grad: a.l frozen weight, b.l frozen weight."""
    def block(name: str, cls: str) -> ModuleSpec:
        return ModuleSpec(name, cls, children=(ModuleSpec("l", "Linear", (ParamSpec("weight", (3, 3), False), ParamSpec("bias", (3,), True))),))

    return CaseSpec(
        tree=ModuleSpec("", "M", children=(block("a", "A"), block("b", "B"), linear("z", 2, 2))),
        classes=CLASSES,
        plan=WrapPlan(policy=ModuleWrap(("A",)), use_orig_params=use_orig_params),
    )
