"""Strategies for FSDP2 cases: shard groups (per-module reshard_after_forward,
the list form for modules that share parameters) over drawn trees, with
their forward methods and calls."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from conformance.areas.common.fsdp2_oracle import ITERATED_CONTAINERS, predict_fsdp2
from conformance.case.graph import ModelGraph
from conformance.case.spec import CaseSpec, ShardGroup, WrapPlan
from conformance.strategies._common import ANY_TORCH, TreeIndex, check_bool, check_int, maybe, pick, pick_subset
from conformance.strategies.cases import case_specs
from conformance.strategies.methods import draw_calls, draw_methods, draw_sibling_methods

RESHARD = (None, True, False)  # simplest (torch's default) first


def shardable(index: TreeIndex, path: str) -> bool:
    """fully_shard may take it and the case calls it as a module: not the
    root, not torch's ModuleList or ModuleDict (iterated, never called);
    torch's Sequential given to fully_shard is called (conformance.case.build.call_child)."""
    return path != "" and index.modules[path].cls not in ITERATED_CONTAINERS


def draw_groups(draw: Any, spec: CaseSpec, *, max_groups: int, split_ties: bool) -> tuple[ShardGroup, ...]:
    index = TreeIndex(spec.tree, spec.classes)
    graph = ModelGraph(spec)
    candidates = [p for p in index.paths if shardable(index, p)]
    groups: list[ShardGroup] = []
    used: set[str] = set()
    # the multi-module form for a tie between two modules neither of which
    # holds the other: fully_shard([a, b])
    for t in spec.ties:
        a, b = index.param_owner[t.source], t.module
        if a == b or a in used or b in used or not (shardable(index, a) and shardable(index, b)):
            continue
        if b in graph.subtree(a) or a in graph.subtree(b) or not maybe(draw, 1):
            continue
        groups.append(ShardGroup((a, b), pick(draw, RESHARD)))
        used.update((a, b))
        event("shard group: multi-module (tie)")
    for p in pick_subset(draw, [c for c in candidates if c not in used], min_size=0, max_size=max_groups):
        groups.append(ShardGroup((p,), pick(draw, RESHARD)))
    if maybe(draw, 2):
        root = ShardGroup(("",), pick(draw, RESHARD))
        if root.reshard_after_forward is not None:
            groups.append(root)
    plan = dataclasses.replace(spec.plan, api="fsdp2", policy=None, ignored_modules=(), ignored_params=(), groups=tuple(groups))
    out = dataclasses.replace(spec, plan=plan)
    if not split_ties:
        # drop groups (last first) until no tie is split between groups
        while out.plan.groups and predict_fsdp2(out, ANY_TORCH).split_ties:
            out = dataclasses.replace(out, plan=dataclasses.replace(out.plan, groups=out.plan.groups[:-1]))
    return out.plan.groups


@st.composite
def _fsdp2_case_specs(draw: Any, base: SearchStrategy, max_groups: int, split_ties: bool, methods: bool,
                      max_methods: int, max_steps: int, max_calls: int) -> CaseSpec:
    spec = draw(base)
    groups = draw_groups(draw, spec, max_groups=max_groups, split_ties=split_ties)
    spec = dataclasses.replace(spec, plan=WrapPlan(api="fsdp2", groups=groups, ignored_params=spec.plan.ignored_params))
    if methods:
        ms = draw_methods(draw, spec, max_methods=max_methods, max_steps=max_steps)
        ms += draw_sibling_methods(draw, spec, ms)
        spec = dataclasses.replace(spec, methods=ms, calls=draw_calls(draw, ms, max_calls=max_calls))
    return spec


def fsdp2_case_specs(
    *,
    max_modules: int = 12,
    max_depth: int = 3,
    max_groups: int = 3,
    split_ties: bool = False,
    allow_ties: bool = True,
    allow_shared: bool = True,
    freeze: bool = True,
    methods: bool = True,
    max_methods: int = 3,
    max_steps: int = 4,
    max_calls: int = 3,
    allow_ignored: bool = False,
) -> SearchStrategy[CaseSpec]:
    """FSDP2 CaseSpecs: a tree (:func:`case_specs`), up to ``max_groups``
    single-module shard groups with reshard_after_forward drawn per group
    (None, True, False), sometimes the root's own setting, sometimes
    fully_shard([a, b]) for the two modules of a tie; with ``split_ties``
    False, no tie split between groups. With ``methods``, 1..``max_methods``
    forward methods on drawn modules (root or not) whose steps read
    parameters directly (mostly ones the method's own group manages, tied
    ones included), call submodules, self.forward or self(...); and calls that
    start at the root, run each method, some several times in a row, some
    with a positional and a keyword argument. With ``allow_ignored``,
    sometimes 1..2 parameters passed to every fully_shard call as
    ``ignored_params`` (torch >= 2.7), which no group may then manage."""
    for name, v in (("max_groups", max_groups), ("max_methods", max_methods), ("max_steps", max_steps), ("max_calls", max_calls)):
        check_int(v, name, min_value=1)
    for name, v in (("split_ties", split_ties), ("methods", methods), ("allow_ignored", allow_ignored)):
        check_bool(v, name)
    base = case_specs(
        max_modules=max_modules, max_depth=max_depth, apis=st.just("fsdp2"), use_orig_params=st.just(False),
        policies=[None], allow_ties=allow_ties, allow_shared=allow_shared, allow_ignored=allow_ignored, freeze=freeze,
    )
    return _fsdp2_case_specs(base, max_groups, split_ties, methods, max_methods, max_steps, max_calls)
