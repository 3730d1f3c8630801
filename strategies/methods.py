"""Strategies for FSDP2 cases: shard groups (per-module reshard_after_forward,
the multi-module form for tied parameters), user forward methods drawn onto
random modules, the calls that run them, and training plans."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.areas.common.fsdp2_oracle import TORCH_CONTAINERS, predict_fsdp2
from conformance.case.graph import ModelGraph
from conformance.case.spec import METHOD_NAMES, OPTIMIZERS, CaseSpec, ForwardMethod, MethodCall, MethodStep, ShardGroup, TrainPlan, WrapPlan
from conformance.case.tree import join
from strategies._common import TreeIndex, check_bool, check_int, ints, maybe, pick, pick_subset
from strategies.cases import case_specs

RESHARD = (None, True, False)  # simplest (torch's default) first
# Step kinds, simplest first; "param" twice so that direct reads are common.
STEP_OPS = ("param", "child", "param", "forward", "call")
# A torch release for drawing only: whether a tie split between groups is
# avoided does not depend on the installed torch.
_ANY_TORCH = "2.13.0"


def _shardable(index: TreeIndex, path: str) -> bool:
    """fully_shard may take it and the case calls it as a module (torch's own
    containers are iterated, not called)."""
    return path != "" and index.modules[path].cls not in TORCH_CONTAINERS


def draw_groups(draw: Any, spec: CaseSpec, *, max_groups: int, split_ties: bool) -> tuple[ShardGroup, ...]:
    index = TreeIndex(spec.tree, spec.classes)
    graph = ModelGraph(spec)
    candidates = [p for p in index.paths if _shardable(index, p)]
    groups: list[ShardGroup] = []
    used: set[str] = set()
    # the multi-module form for a tie between two modules neither of which
    # holds the other: fully_shard([a, b])
    for t in spec.ties:
        a, b = index.param_owner[t.source], t.module
        if a == b or a in used or b in used or not (_shardable(index, a) and _shardable(index, b)):
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
        while out.plan.groups and predict_fsdp2(out, _ANY_TORCH).split_ties:
            out = dataclasses.replace(out, plan=dataclasses.replace(out.plan, groups=out.plan.groups[:-1]))
    return out.plan.groups


def _param_targets(g: ModelGraph, nid: str) -> list[tuple[str, str]]:
    """(attribute path relative to ``nid``, param id) for every parameter
    reachable from ``nid``, aliases included, nearest first."""
    out: list[tuple[str, str]] = []
    stack = [(nid, "", 0)]
    while stack:
        n, prefix, depth = stack.pop(0)
        out += [(join(prefix, name), pid) for name, pid in g.nodes[n].params]
        if depth < 3:
            stack += [(c, join(prefix, name), depth + 1) for name, c in g.nodes[n].children]
    return out


def draw_methods(draw: Any, spec: CaseSpec, *, max_methods: int, max_steps: int) -> tuple[ForwardMethod, ...]:
    index = TreeIndex(spec.tree, spec.classes)
    g = ModelGraph(spec)
    pred = predict_fsdp2(spec, _ANY_TORCH)
    owner: dict[str, int] = {}
    for gi, grp in enumerate(pred.groups):
        for fqn in grp.managed:
            owner[fqn] = gi
    hosts = [p for p in index.paths if p in index.drawn]  # drawn classes: the root first
    methods: list[ForwardMethod] = []
    count = 1 + draw(ints(max_methods - 1)) if max_methods > 1 else 1
    # hosts with a sibling of their class (a ModuleList of Blocks): their
    # methods get an unregistered same-class call (draw_sibling_methods)
    paired = [p for p in hosts if p and any(q != p and index.modules[q].cls == index.modules[p].cls for q in index.paths)]
    for _ in range(count):
        if maybe(draw, 1):
            host = pick(draw, paired) if paired and maybe(draw, 1) else pick(draw, hosts)
        else:
            host = ""
        taken = _attribute_names(index, spec, host) | {m.name for m in methods if m.module == host}
        names = [n for n in METHOD_NAMES if n not in taken]
        if not names:
            continue
        name = pick(draw, names)
        # Reads the oracle can promise: parameters the method's own group
        # manages (the tied head of HF generate() when the embedding is in it).
        gi = pred.group_index(g.module_path[host]) if host in g.module_path else None
        if gi is None:
            gi = next((owner.get(g.param_fqn[pid]) for _, pid in _param_targets(g, host)), None)
        params = [rel for rel, pid in _param_targets(g, host) if owner.get(g.param_fqn[pid]) == gi]
        if maybe(draw, 4):  # now and then anything, promised or not
            params = [rel for rel, _ in _param_targets(g, host)] or params
        children = [c for c in index.children[host]] + [join(s.parent, s.name) for s in spec.shared if s.parent == host]
        children = [c[len(host) + 1:] if host else c for c in children]
        steps: list[MethodStep] = []
        for _ in range(1 + draw(ints(max_steps - 1))):
            op = pick(draw, STEP_OPS)
            if op == "param" and params:
                steps.append(MethodStep("param", pick(draw, params)))
            elif op == "child" and children:
                steps.append(MethodStep("child", pick(draw, children)))
            elif op in ("forward", "call"):
                steps.append(MethodStep(op))
        for st_ in steps:
            event(f"method step: {st_.op}")
        event(f"method on: {'root' if host == '' else 'non-root'}")
        methods.append(ForwardMethod(host, name, tuple(steps)))
    return tuple(methods)


def _attribute_names(index: TreeIndex, spec: CaseSpec, path: str) -> set[str]:
    """The names the module at ``path`` already holds (a method may not take one)."""
    node = index.modules[path]
    taken = {x.name for x in node.params + node.buffers + node.children}
    return taken | {s.name for s in spec.shared if s.parent == path} | {t.name for t in spec.ties if t.module == path}


def draw_sibling_methods(draw: Any, spec: CaseSpec, methods: tuple[ForwardMethod, ...]) -> tuple[ForwardMethod, ...]:
    """For a method registered on a module that has a sibling of the same
    class (FSDP2 gives every FSDP module of a class one class
    FSDP<cls>), the same-named method of that sibling, unregistered and
    with an empty body: registration is per instance, so calling it must
    run without FSDP's hooks and give the reference's output (FWD-ISOLATION)."""
    index = TreeIndex(spec.tree, spec.classes)
    out: list[ForwardMethod] = []
    have = {(m.module, m.name) for m in methods}
    for m in methods:
        if not m.register or m.module not in index.modules:
            continue
        cls = index.modules[m.module].cls
        same = [p for p in index.paths if p != m.module and index.modules[p].cls == cls and (p, m.name) not in have]
        if not same:
            continue
        other = pick(draw, same)
        if m.name in _attribute_names(index, spec, other):
            continue
        have.add((other, m.name))
        event("method on: unregistered same-class sibling")
        out.append(ForwardMethod(other, m.name, (), register=False))
    return tuple(out)


def draw_calls(draw: Any, methods: tuple[ForwardMethod, ...], *, max_calls: int) -> tuple[MethodCall, ...]:
    # The first call runs the root's hooks: lazy init takes the first
    # module to run forward as the root.
    roots = [i for i, m in enumerate(methods) if m.module == "" and m.register]
    first = pick(draw, [-1] + roots)
    calls = [MethodCall(first, 1 + draw(ints(2)), maybe(draw, 1))]
    for _ in range(draw(ints(max_calls - 1))):
        calls.append(MethodCall(pick(draw, list(range(len(methods))) + [-1]), 1 + draw(ints(2)), maybe(draw, 1)))
    # every method runs at least once
    for i in range(len(methods)):
        if all(c.method != i for c in calls):
            calls.append(MethodCall(i, 1, maybe(draw, 1)))
    for c in calls:
        if c.times > 1:
            event("call: repeated")
    return tuple(calls)


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


# FSDP2's gradient reduction settings a plan may draw: (force_sum,
# divide_factor). A divide factor goes with force_sum: without it FSDP2
# reduce-scatters with PREMUL_SUM, which gloo does not have.
REDUCTIONS = ((False, None), (True, None), (True, 1.0), (True, 3.0))


def train_plans(*, max_steps: int = 3, reductions: bool = False) -> SearchStrategy[TrainPlan]:
    """SGD (with momentum) or Adam, 1..max_steps steps; with ``reductions``
    (FSDP2), sometimes set_force_sum_reduction_for_comms(True), with or
    without a gradient divide factor."""
    check_int(max_steps, "max_steps", min_value=1)
    check_bool(reductions, "reductions")
    red = st.one_of(st.just(REDUCTIONS[0]), st.sampled_from(REDUCTIONS[1:])) if reductions else st.just(REDUCTIONS[0])
    return st.builds(
        lambda opt, steps, r: TrainPlan(opt, steps, 0.05, force_sum=r[0], divide_factor=r[1]),
        st.sampled_from(OPTIMIZERS), st.integers(1, max_steps), red,
    )


@st.composite
def _training_specs(draw: Any, cases: SearchStrategy, plans: SearchStrategy) -> CaseSpec:
    spec = draw(cases)
    return dataclasses.replace(spec, train=draw(plans), methods=(), calls=())


def training_specs(
    *, api: str = "fsdp2", max_modules: int = 10, max_depth: int = 3, max_steps: int = 3, reductions: bool = False,
) -> SearchStrategy[CaseSpec]:
    """PARITY cases for ``api``: FSDP2 (:func:`fsdp2_case_specs` without
    methods) or FSDP1 (either use_orig_params, any policy), frozen and tied
    parameters included, with a training plan (``reductions``: FSDP2's
    reduction settings drawn too, see :func:`train_plans`)."""
    if api not in ("fsdp1", "fsdp2"):
        raise InvalidArgument(f"api={api!r} must be 'fsdp1' or 'fsdp2'")
    check_bool(reductions, "reductions")
    if reductions and api != "fsdp2":
        raise InvalidArgument("reductions=True needs api='fsdp2'")
    if api == "fsdp2":
        cases = fsdp2_case_specs(max_modules=max_modules, max_depth=max_depth, methods=False)
    else:
        # FSDP1's recorded tie and shared-module findings (a tie split between
        # units, a module under two names) corrupt its collectives, so that
        # ranks hang in training: TIES and the WRAP invariants cover those.
        cases = case_specs(max_modules=max_modules, max_depth=max_depth, allow_ignored=False, allow_shared=False).filter(_fsdp1_trainable)
    return _training_specs(cases, train_plans(max_steps=max_steps, reductions=reductions))


def _fsdp1_trainable(spec: CaseSpec) -> bool:
    from conformance.areas.common.fsdp1_oracle import fsdp1_case_tags, predict_fsdp1

    pred = predict_fsdp1(spec)
    # A unit that is torch's own container: the case iterates its children
    # rather than calling it, so FSDP never all-gathers for it (outside what
    # FSDP promises; the ranks then fail on their own shards and hang).
    g = ModelGraph(spec)
    containers = any(g.is_torch(g.resolve_module(u.path), TORCH_CONTAINERS, exact=True) for u in pred.units)
    return "tie:cross-unit" not in fsdp1_case_tags(spec, pred) and not pred.shared_modules and not containers


def summon_specs(*, max_modules: int = 10, max_depth: int = 3) -> SearchStrategy[CaseSpec]:
    """FWD-SUMMON cases: FSDP1 (either use_orig_params, any policy) with
    methods on the root run through the summon_full_params workaround."""
    base = case_specs(max_modules=max_modules, max_depth=max_depth, allow_ignored=False, allow_shared=False)
    return _summon(base.filter(_fsdp1_trainable))


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
    from conformance.areas.common.fsdp1_oracle import predict_fsdp1

    p1 = predict_fsdp1(spec)
    root = set(p1.unit("").managed) if p1.error is None else set()
    params = [rel for rel, pid in _param_targets(g, "") if g.param_fqn[pid] in root]
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
