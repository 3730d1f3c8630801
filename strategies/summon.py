"""Strategies for the FSDP1 forward-method workaround (FWD-SUMMON): root
methods over cases FSDP1 trains."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.case.graph import ModelGraph
from conformance.case.spec import METHOD_NAMES, CaseSpec, ForwardMethod, MethodCall, MethodStep
from conformance.strategies._common import TreeIndex, ints, maybe, pick
from conformance.strategies.cases import case_specs
from conformance.strategies.methods import param_targets
from conformance.strategies.training import fsdp1_trainable


def summon_specs(*, max_modules: int = 10, max_depth: int = 3) -> SearchStrategy[CaseSpec]:
    """FWD-SUMMON cases: FSDP1 (either use_orig_params, any policy) with
    methods on the root run through the summon_full_params workaround."""
    base = case_specs(max_modules=max_modules, max_depth=max_depth, allow_ignored=False, allow_shared=False)
    # a method calls the root's children inside summon_full_params, and a
    # Sequential unit is called through its FSDP1 wrapper: its forward would
    # start inside the context, which summon_full_params's docstring rules
    # out ("Nor can forward and backward be started from within this context.")
    return _summon(base.filter(lambda s: fsdp1_trainable(s, sequential_units=False)))


@st.composite
def _summon(draw: Any, base: SearchStrategy) -> CaseSpec:
    spec = draw(base)
    g = ModelGraph(spec)
    index = TreeIndex(spec.tree, spec.classes)
    taken = {x.name for x in spec.tree.params + spec.tree.buffers + spec.tree.children}
    taken |= {s.name for s in spec.shared if s.parent == ""} | {t.name for t in spec.ties if t.module == ""}
    names = [n for n in METHOD_NAMES if n not in taken]
    # Only parameters the root unit manages: with use_orig_params=False a
    # nested unit's parameter read outside its forward is a view of freed
    # storage (reading it can crash the process, not just give wrong values).

    p1 = predict_fsdp1(spec)
    root = set(p1.unit("").managed) if p1.error is None else set()
    params = [rel for rel, pid in param_targets(g, "") if g.param_fqn[pid] in root]
    steps: list[MethodStep] = []
    # summon_full_params: no forward may start inside the context (its
    # docstring); a nested unit's forward there can hang the ranks, so the
    # method runs module forwards only when there are no nested units.
    ops = ("param", "forward", "call", "child") if spec.plan.policy is None else ("param",)
    for _ in range(1 + draw(ints(2))):
        op = pick(draw, ops)
        if op == "param" and params:
            steps.append(MethodStep("param", pick(draw, params)))
        elif op == "child" and index.children[""]:
            steps.append(MethodStep("child", pick(draw, index.children[""])))
        elif op in ("forward", "call"):
            steps.append(MethodStep(op))
    m = ForwardMethod("", pick(draw, names), tuple(steps))
    calls = (MethodCall(0, 1 + draw(ints(1)), maybe(draw, 1)),) + ((MethodCall(-1),) if maybe(draw, 1) else ())
    return dataclasses.replace(spec, methods=(m,), calls=calls)
