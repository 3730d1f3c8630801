"""Cases where several FSDP1 units mix requires_grad, so that the order in
which the frozen-parameter check meets them is observable.

A freeze mask drawn on its own rarely makes two non-root units mixed (about
one case in twenty): the first-violator and warning-order promises of spec
source 000 then go mostly unchecked (a traversal-order mutant
survived). Here the mask follows the units the oracle predicts: a few of
them get one parameter frozen each."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import assume, event
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.case.graph import ModelGraph
from conformance.case.spec import CaseSpec, CustomWrap, ModuleWrap
from conformance.strategies._common import check_strategy, pick
from conformance.strategies.cases import case_specs
from conformance.strategies.freeze import apply_freeze_mask
from conformance.strategies.trees import module_trees


def _disjoint_holders(m) -> tuple[int, int]:
    """(parameters in m's subtree, most disjoint modules of that subtree,
    m included, that hold two parameters or more each)."""
    count, below = len(m.params), 0
    for c in m.children:
        n, d = _disjoint_holders(c)
        count += n
        below += d
    return count, max(below, 1 if count >= 2 else 0)


def _room_for_two_units(drawn) -> bool:
    """Two non-root modules, neither inside the other, with two parameters
    or more each: without them no policy makes two mixed non-root units."""
    tree, _ = drawn
    return sum(_disjoint_holders(c)[1] for c in tree.children) >= 2


# Trees without that room were two in three of this strategy's draws, each
# a whole example rejected (assume below): filtered at the tree, a retry
# redraws the tree alone.
_ROOMY_TREES = module_trees().filter(_room_for_two_units)
# No unit mixes requires_grad in a tree of one parameter (one draw in ten)
_TWO_PARAM_TREES = module_trees().filter(lambda drawn: _disjoint_holders(drawn[0])[0] >= 2)


@st.composite
def _several_mixed_units(draw: Any, use_orig_params: SearchStrategy[bool]) -> CaseSpec:
    # Object policies (the ones torch validates); no ties or shared modules:
    # the plain first-violator order, which other tests cover with them.
    spec = draw(case_specs(use_orig_params=use_orig_params, policies=[ModuleWrap, CustomWrap],
                           allow_ties=False, allow_shared=False, freeze=False, trees=_ROOMY_TREES))
    units = [u for u in predict_fsdp1(spec).units if u.path and len(u.managed) >= 2]
    if len(units) < 2:
        # The drawn policy made fewer than two such units (five draws in six):
        # aim a CustomWrap at 2..4 disjoint modules holding two parameters or
        # more each, instead of rejecting the draw.
        spec = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, policy=_disjoint_targets(draw, spec)))
        units = [u for u in predict_fsdp1(spec).units if u.path and len(u.managed) >= 2]
        event("policy: CustomWrap aimed at disjoint modules")
    assume(len(units) >= 2)
    # 2..4 distinct units (pick_subset drops repeated picks: one unit in four draws)
    chosen = draw(st.permutations(units))[: draw(st.integers(2, min(4, len(units))))]
    event(f"mixed units: {len(chosen)}")
    mask = {pick(draw, sorted(u.managed)): False for u in chosen}
    return dataclasses.replace(spec, tree=apply_freeze_mask(spec.tree, mask))


def _disjoint_targets(draw: Any, spec: CaseSpec) -> CustomWrap:
    g = ModelGraph(spec)
    # parameters the plan ignores belong to no unit
    ignored = {g.resolve_param(f) for f in spec.plan.ignored_params}
    for path in spec.plan.ignored_modules:
        ignored.update(g.subtree_params(g.resolve_module(path)))
    holders = [path for path, nid in g.named_modules()
               if path and len([p for p in g.subtree_params(nid) if p not in ignored]) >= 2]
    # only modules with a disjoint partner: a first pick that contains or
    # lies inside every other holder would leave the draw one target short
    candidates = [p for p in holders if any(not _nested(p, q) for q in holders if q != p)]
    want = draw(st.integers(2, 4))
    chosen: list[str] = []
    for path in draw(st.permutations(candidates)):
        if not any(_nested(path, c) for c in chosen):
            chosen.append(path)
            if len(chosen) == want:
                break
    assume(len(chosen) >= 2)
    return CustomWrap(tuple(sorted(chosen)))


def _nested(a: str, b: str) -> bool:
    return a.startswith(b + ".") or b.startswith(a + ".")


@st.composite
def _mixed_unit_cases(draw: Any, use_orig_params: SearchStrategy[bool]) -> CaseSpec:
    # any case (ties, shared modules, every policy and freeze mask) ...
    spec = draw(case_specs(use_orig_params=use_orig_params, trees=_TWO_PARAM_TREES))
    pred = predict_fsdp1(spec)
    if pred.error is not None or pred.warnings:
        return spec
    # ... made mixed where the mask left every unit uniform: one parameter
    # of one unit (the root's included) flipped
    units = [u for u in pred.units if len(set(u.managed)) >= 2]
    assume(units)
    unit = pick(draw, units)
    g = ModelGraph(spec)
    pid = g.resolve_param(pick(draw, sorted(set(unit.managed))))
    event("mixed unit: made")
    return dataclasses.replace(spec, tree=apply_freeze_mask(spec.tree, {pid: not g.requires_grad(pid)}, spec.ties))


def mixed_unit_cases(*, use_orig_params: SearchStrategy[bool] = st.booleans()) -> SearchStrategy[CaseSpec]:
    """FSDP1 CaseSpecs (any policy, ties, shared modules, freeze mask) in
    which at least one unit mixes requires_grad: a drawn case as it is when
    its mask already mixes a unit, else with one parameter of one unit
    flipped (so that the error and warning paths are drawn without
    rejecting most cases)."""
    check_strategy(use_orig_params, "use_orig_params")
    return _mixed_unit_cases(use_orig_params)


def several_mixed_units(*, use_orig_params: SearchStrategy[bool] = st.booleans()) -> SearchStrategy[CaseSpec]:
    """FSDP1 CaseSpecs (ModuleWrap / CustomWrap) in which 2..4 non-root units
    each have one parameter frozen and the rest trainable."""
    check_strategy(use_orig_params, "use_orig_params")
    return _several_mixed_units(use_orig_params)
