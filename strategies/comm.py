"""Strategies for the communication invariants (COMM-*): trees with frozen
parameters under FSDP2 groups (reshard_after_forward None / True / False /
an int, for the root too; explicit forward and backward prefetching) or
FSDP1 units (sharding strategy, backward_prefetch, forward_prefetch,
limit_all_gathers, iterations inside no_sync()), mixed precision, one to three iterations, parameters
frozen or unfrozen after the first (FSDP2; FSDP1 with use_orig_params=True), and sometimes a one-rank mesh (FSDP2)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.areas.common.fsdp2_oracle import predict_fsdp2
from conformance.case.spec import (
    FSDP1_BACKWARD_PREFETCH,
    FSDP1_STRATEGIES,
    CaseSpec,
    CommPlan,
    CustomWrap,
    ShardGroup,
    WrapPlan,
    param_fqns,
)
from conformance.case.tree import join, walk
from conformance.strategies._common import ANY_TORCH, TreeIndex, check_int, ints, maybe, pick, pick_subset
from conformance.strategies.cases import case_specs
from conformance.strategies.groups import shardable
from conformance.strategies.training import fsdp1_trainable

# reshard_after_forward per group: torch's default first; 2 reshards to
# two ranks (a non-trivial divisor of the fake tier's four)
RESHARD = (None, True, False, 2)
# (param_dtype, reduce_dtype): unset first
PRECISIONS = ((None, None), ("bfloat16", None), ("bfloat16", "float32"), ("float16", "float32"), (None, "bfloat16"))


def draw_groups(draw: Any, spec: CaseSpec, choices: tuple, max_groups: int) -> CaseSpec:
    """Up to ``max_groups`` single-module FSDP2 groups, reshard_after_forward
    from ``choices`` each, sometimes the root's own setting; groups FSDP2
    does not promise to run (a torch container, a module never called) dropped."""
    index = TreeIndex(spec.tree, spec.classes)
    groups = [ShardGroup((p,), pick(draw, choices)) for p in
              pick_subset(draw, [p for p in index.paths if shardable(index, p)], min_size=0, max_size=max_groups)]
    if maybe(draw, 2):
        groups.append(ShardGroup(("",), pick(draw, choices[1:])))
    spec = dataclasses.replace(spec, plan=WrapPlan(api="fsdp2", groups=tuple(groups)))
    while predict_fsdp2(spec, ANY_TORCH).supported and spec.plan.groups:
        spec = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, groups=spec.plan.groups[:-1]))
    return spec


def _draw_refreeze(draw: Any, spec: CaseSpec, iterations: int) -> tuple[str, ...]:
    """Parameters whose requires_grad flips after the first iteration: none
    (about a quarter of the time), a module's subtree frozen (its trainable
    parameters) or unfrozen (its frozen ones), as a user freezes or unfreezes
    a block, or one or two parameters anywhere."""
    fqns = param_fqns(spec.tree)
    if iterations < 2 or not any(p.requires_grad for _, m in walk(spec.tree) for p in m.params) or not maybe(draw, 3):
        return ()  # nothing trainable: no backward first, after which a refreeze is not promised (comm_oracle.NO_BACKWARD_FIRST)
    how = pick(draw, ("freeze", "unfreeze", "parameters"))
    if how != "parameters":
        root = pick(draw, [p for p, _ in walk(spec.tree)])
        trainable = {join(path, p.name): p.requires_grad for path, m in walk(spec.tree) for p in m.params}
        out = tuple(f for f in fqns if (not root or f.startswith(root + ".")) and trainable[f] == (how == "freeze"))
        if out:
            event(f"comm: {how} a subtree")
            return out
    event("comm: refreeze parameters")
    return tuple(pick_subset(draw, fqns, min_size=1, max_size=2))


def _draw_prefetch(draw: Any, modules: list[str], label: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    out = []
    if len(modules) < 2 or not maybe(draw, 2):
        return ()
    for m in pick_subset(draw, modules, min_size=1, max_size=2):
        others = [t for t in modules if t != m]
        out.append((m, tuple(pick_subset(draw, others, min_size=1, max_size=2))))
    event(f"comm: explicit {label} prefetch")
    return tuple(out)


@st.composite
def _fsdp2_comm_specs(draw: Any, base: SearchStrategy, max_groups: int, max_iterations: int) -> CaseSpec:
    spec = draw(base)
    world = 1 if maybe(draw, 1) else 0
    spec = draw_groups(draw, spec, RESHARD if world == 0 else RESHARD[:3], max_groups)
    modules = [g.modules[0] for g in spec.plan.groups if g.modules != ("",)] + [""]
    fwd = _draw_prefetch(draw, modules, "forward")
    bwd = _draw_prefetch(draw, modules, "backward")
    param, reduce = pick(draw, PRECISIONS)
    iterations = 1 + draw(ints(max_iterations - 1))
    plan = CommPlan(iterations=iterations, world=world, param_dtype=param, reduce_dtype=reduce,
                    forward_prefetch=fwd, backward_prefetch=bwd, refreeze=_draw_refreeze(draw, spec, iterations))
    event(f"comm: fsdp2, {len(spec.plan.groups)} groups, world {'1' if world else 'all'}")
    return dataclasses.replace(spec, comm=plan)


def _fsdp1_ok(spec: CaseSpec) -> bool:
    return fsdp1_trainable(spec) and predict_fsdp1(spec).error is None


@st.composite
def _fsdp1_comm_specs(draw: Any, base: SearchStrategy, max_iterations: int) -> CaseSpec:
    spec = draw(base)
    pol = spec.plan.policy
    if isinstance(pol, CustomWrap) and pol.kwargs:  # the sharding strategy is the plan's, for every unit
        spec = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, policy=CustomWrap(pol.targets)))
    param, reduce = pick(draw, PRECISIONS)
    iterations = 1 + draw(ints(max_iterations - 1))
    # some iterations inside no_sync() (gradient accumulation), most often
    # before a synced one, as a training loop does
    no_sync = tuple(maybe(draw, 2) for _ in range(iterations)) if maybe(draw, 2) else ()
    plan = CommPlan(
        iterations=iterations, param_dtype=param, reduce_dtype=reduce,
        sharding_strategy=pick(draw, FSDP1_STRATEGIES), fsdp1_backward_prefetch=pick(draw, ("BACKWARD_PRE",) + tuple(x for x in FSDP1_BACKWARD_PREFETCH if x != "BACKWARD_PRE")),
        fsdp1_forward_prefetch=maybe(draw, 2), limit_all_gathers=not maybe(draw, 2), fsdp1_no_sync=no_sync if any(no_sync) else (),
    )
    if spec.plan.use_orig_params and not (plan.fsdp1_no_sync and plan.fsdp1_no_sync[0]):
        # the flat parameters follow their original parameters' requires_grad with use_orig_params=True only
        plan = dataclasses.replace(plan, refreeze=_draw_refreeze(draw, spec, iterations))
    event(f"comm: fsdp1 {plan.sharding_strategy}, backward_prefetch {plan.fsdp1_backward_prefetch}")
    if plan.fsdp1_no_sync:
        event(f"comm: fsdp1 no_sync, {plan.sharding_strategy}")
    return dataclasses.replace(spec, comm=plan)


def comm_specs(*, api: str = "fsdp2", max_modules: int = 8, max_depth: int = 3, max_groups: int = 4,
               max_iterations: int = 3) -> SearchStrategy[CaseSpec]:
    """CaseSpecs with a CommPlan for ``api``: the trees of :func:`case_specs`
    (frozen parameters included; no ties, shared modules or ignored
    parameters, whose collectives other invariants and findings cover),
    FSDP2 with up to ``max_groups`` single-module groups or FSDP1 under any
    policy, 1..``max_iterations`` iterations."""
    if api not in ("fsdp1", "fsdp2"):
        raise InvalidArgument(f"api={api!r} must be 'fsdp1' or 'fsdp2'")
    for name, v in (("max_modules", max_modules), ("max_groups", max_groups), ("max_iterations", max_iterations)):
        check_int(v, name, min_value=1)
    check_int(max_depth, "max_depth", min_value=0)
    common = dict(max_modules=max_modules, max_depth=max_depth, allow_ties=False, allow_shared=False, allow_ignored=False)
    if api == "fsdp2":
        base = case_specs(apis=st.just("fsdp2"), use_orig_params=st.just(False), policies=[None], **common)
        return _fsdp2_comm_specs(base, max_groups, max_iterations)
    return _fsdp1_comm_specs(case_specs(**common).filter(_fsdp1_ok), max_iterations)
