"""Strategies for FSDP2 cases: shard groups (per-module reshard_after_forward,
the multi-module form for tied parameters), user forward methods drawn onto
random modules, the calls that run them, and training plans."""

from __future__ import annotations

from typing import Any

from hypothesis import event

from conformance.areas.common.fsdp2_oracle import predict_fsdp2
from conformance.case.graph import ModelGraph
from conformance.case.spec import METHOD_NAMES, CaseSpec, ForwardMethod, MethodCall, MethodStep
from conformance.case.tree import join
from conformance.strategies._common import ANY_TORCH, TreeIndex, ints, maybe, pick

# Step kinds, simplest first; "param" twice so that direct reads are common.
STEP_OPS = ("param", "child", "param", "forward", "call")


def param_targets(g: ModelGraph, nid: str) -> list[tuple[str, str]]:
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
    pred = predict_fsdp2(spec, ANY_TORCH)
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
            gi = next((owner.get(g.param_fqn[pid]) for _, pid in param_targets(g, host)), None)
        params = [rel for rel, pid in param_targets(g, host) if owner.get(g.param_fqn[pid]) == gi]
        if maybe(draw, 4):  # now and then anything, promised or not
            params = [rel for rel, _ in param_targets(g, host)] or params
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


