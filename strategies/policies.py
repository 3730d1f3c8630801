"""Strategies for wrap policies and wrap plans (API, policy, use_orig_params,
ignored modules and parameters)."""

from __future__ import annotations

from typing import Any, Iterable

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.case.spec import (
    CUSTOM_KWARGS,
    CaseSpec,
    CustomWrap,
    LambdaWrap,
    ModuleWrap,
    Policy,
    SharedModule,
    SizeBasedWrap,
    TiedParam,
    TransformerWrap,
    WrapPlan,
)
from conformance.case.tree import join
from conformance.strategies._common import TreeIndex, check_bool, check_kinds, check_strategy, maybe, pick, pick_subset

# None (no auto-wrap policy) first: the simplest plan.
POLICY_KINDS = (None, ModuleWrap, CustomWrap, SizeBasedWrap, LambdaWrap, TransformerWrap)
APIS = ("fsdp1", "fsdp2")
_KWARG_KEYS = tuple(CUSTOM_KWARGS)
# Mostly nothing ignored; else modules or parameters, not both: FSDP1 rejects
# ignored_modules together with ignored_states.
_IGNORE = ("none", "none", "none", "none", "modules", "params")
# FSDP1's policy objects (ModuleWrapPolicy, CustomPolicy) skip ignored
# modules themselves (_Policy._run_policy): ignored modules are drawn more
# often with them, so that the skip is exercised within the ci budget.
_IGNORE_OBJECT_POLICY = ("none", "none", "modules", "modules", "params")
# fully_shard has ignored_params only
_IGNORE_FSDP2 = ("none", "none", "params")
OBJECT_POLICIES = (ModuleWrap, CustomWrap)


def check_policy_kinds(value: Any, name: str = "policies") -> tuple:
    return POLICY_KINDS if value is None else check_kinds(value, name, POLICY_KINDS)


# ---- subtree sizes -------------------------------------------------------------------


def _subtree_numels(index: TreeIndex, shared: tuple[SharedModule, ...], ties: tuple[TiedParam, ...]) -> dict[str, int]:
    replaced = {join(t.module, t.name): t.source for t in ties}
    own: dict[str, list[str]] = {
        path: [replaced.get(join(path, p.name), join(path, p.name)) for p in m.params]
        for path, m in index.modules.items()
    }
    for t in ties:
        if join(t.module, t.name) not in index.params:
            own[t.module].append(t.source)
    below: dict[str, list[str]] = {p: list(c) for p, c in index.children.items()}
    for s in shared:
        below[s.parent].append(s.source)
    memo: dict[str, frozenset[str]] = {}

    def ids(path: str) -> frozenset[str]:
        got = memo.get(path)
        if got is None:
            acc = set(own[path])
            for c in below[path]:
                acc |= ids(c)
            got = memo[path] = frozenset(acc)
        return got

    return {path: sum(index.params[f].numel for f in ids(path)) for path in index.paths}


def subtree_numels(spec: CaseSpec) -> dict[str, int]:
    """{module path: numel of module.parameters()} for the built model: each
    distinct Parameter counted once, shared modules and ties included (what
    size_based_auto_wrap_policy compares min_num_params with, before any
    child is wrapped)."""
    if not isinstance(spec, CaseSpec):
        raise InvalidArgument(f"spec={spec!r} must be a CaseSpec")
    return _subtree_numels(TreeIndex(spec.tree, spec.classes), spec.shared, spec.ties)


# ---- policies ------------------------------------------------------------------------


def _class_candidates(index: TreeIndex) -> list[str]:
    """Classes a ModuleWrap / TransformerWrap may name: those of the tree's
    modules, each followed by its drawn bases (so a subclass matches), then
    the root's class, then Module itself (matching every module)."""
    bases = {c.name: c.base for c in index.classes}
    out: list[str] = []
    for path in index.paths[1:]:
        cls = index.modules[path].cls
        while cls not in out and cls != "Module":
            out.append(cls)
            cls = bases.get(cls, "Module")
    cls = index.tree.cls
    while cls not in out and cls != "Module":
        out.append(cls)
        cls = bases.get(cls, "Module")
    out.append("Module")
    return out


def draw_policy(
    draw: Any, index: TreeIndex, shared: tuple[SharedModule, ...], ties: tuple[TiedParam, ...], kind: type | None
) -> Policy | None:
    """A policy of ``kind`` (a policy class, or None) for the tree."""
    event(f"policy: {getattr(kind, '__name__', kind)}")
    if kind is None:
        return None
    if kind in (ModuleWrap, TransformerWrap):
        return kind(tuple(pick_subset(draw, _class_candidates(index), min_size=1, max_size=3)))
    # Paths in pre-order, the root last: wrapping the root is a no-op.
    paths = index.paths[1:] + [""]
    if kind is LambdaWrap:
        return LambdaWrap(tuple(pick_subset(draw, paths, min_size=1, max_size=4)))
    if kind is CustomWrap:
        targets = tuple(pick_subset(draw, paths, min_size=1, max_size=4))
        kwargs = []
        for t in pick_subset(draw, targets, min_size=0, max_size=2):
            keys = pick_subset(draw, _KWARG_KEYS, min_size=1, max_size=2)
            kwargs.append((t, tuple((k, pick(draw, CUSTOM_KWARGS[k])) for k in keys)))
        return CustomWrap(targets, tuple(kwargs))
    # SizeBasedWrap: a real subtree size, exactly or one off, so that the
    # policy's >= comparison is hit on both sides of its boundary.
    sizes = sorted(set(_subtree_numels(index, shared, ties).values()))
    size = pick(draw, sizes)
    return SizeBasedWrap(max(0, size + pick(draw, (0, -1, 1))))


@st.composite
def _policies(draw: Any, spec: CaseSpec, kinds: tuple) -> Policy | None:
    kind = pick(draw, kinds)
    return draw_policy(draw, TreeIndex(spec.tree, spec.classes), spec.shared, spec.ties, kind)


def policies(spec: CaseSpec, *, kinds: Iterable | None = None) -> SearchStrategy[Policy | None]:
    """An auto-wrap policy for ``spec`` (its plan is ignored), of one of
    ``kinds``: policy classes from conformance.case.spec and None for no policy
    (default: all of them). ModuleWrap / TransformerWrap name 1..3 classes
    of the tree, base classes and torch's own included; CustomWrap names 1..4
    paths, some with kwargs from CUSTOM_KWARGS; LambdaWrap 1..4 paths;
    SizeBasedWrap a min_num_params equal to a subtree's size or one off."""
    if not isinstance(spec, CaseSpec):
        raise InvalidArgument(f"spec={spec!r} must be a CaseSpec")
    return _policies(spec, check_policy_kinds(kinds, "kinds"))


# ---- wrap plans ------------------------------------------------------------------------


class PlanChoices:
    """The choices of a plan that do not depend on the tree. Drawn before the
    tree, at fixed positions in the choice sequence: drawn after a tree of
    varying size they would often be filled with the simplest value when
    Hypothesis replays a mutated prefix, skewing them towards no policy."""

    __slots__ = ("api", "use_orig_params", "policy_kind", "ignore")

    def __init__(self, draw: Any, apis: SearchStrategy[str], use_orig_params: SearchStrategy[bool], kinds: tuple, allow_ignored: bool) -> None:
        self.api = draw(apis)
        if self.api not in APIS:
            raise InvalidArgument(f"apis generated {self.api!r}; it must generate one of {APIS}")
        self.use_orig_params = draw(use_orig_params)
        if not isinstance(self.use_orig_params, bool):
            raise InvalidArgument(f"use_orig_params generated {self.use_orig_params!r}; it must generate bools")
        self.policy_kind = pick(draw, kinds)
        if not allow_ignored:
            self.ignore = "none"
        else:
            if self.api == "fsdp2":
                self.ignore = pick(draw, _IGNORE_FSDP2)
            else:
                self.ignore = pick(draw, _IGNORE_OBJECT_POLICY if self.policy_kind in OBJECT_POLICIES else _IGNORE)


def draw_plan(
    draw: Any, index: TreeIndex, shared: tuple[SharedModule, ...], ties: tuple[TiedParam, ...], choices: PlanChoices
) -> WrapPlan:
    policy = draw_policy(draw, index, shared, ties, choices.policy_kind)
    ignored_modules: tuple[str, ...] = ()
    ignored_params: tuple[str, ...] = ()
    # fully_shard has ignored_params but no ignored_modules.
    if choices.ignore == "modules" and choices.api == "fsdp1" and len(index.paths) > 1:
        ignored_modules = tuple(pick_subset(draw, index.paths[1:], min_size=1, max_size=2))
        event("ignored modules")
    elif choices.ignore == "params" and index.params:
        ignored_params = tuple(pick_subset(draw, list(index.params), min_size=1, max_size=2))
        event("ignored params")
    if choices.api == "fsdp1" and isinstance(policy, OBJECT_POLICIES):
        policy = _aim_object_policy(draw, index, policy, ignored_modules, shared)
    return WrapPlan(choices.api, policy, choices.use_orig_params, ignored_modules, ignored_params)


def _subtree_paths(index: TreeIndex, top: str) -> list[str]:
    return [p for p in index.paths if p == top or p.startswith(top + ".")]


def _aim_object_policy(
    draw: Any, index: TreeIndex, policy: Policy, ignored_modules: tuple[str, ...], shared: tuple[SharedModule, ...]
) -> Policy:
    """Often make the policy select a module inside an ignored module (which
    the policy object must skip) or inside a shared module (which the
    post-order traversal must visit once, not once per parent): both are
    rare when the targets are drawn blind."""
    spots = [p for top in ignored_modules for p in _subtree_paths(index, top)]
    spots += [p for s in shared for p in _subtree_paths(index, s.source)]
    if not spots or not maybe(draw, 2):
        return policy
    path = pick(draw, spots)
    event("policy aimed inside an ignored or shared module")
    if isinstance(policy, CustomWrap):
        return policy if path in policy.targets else CustomWrap(policy.targets + (path,), policy.kwargs)
    cls = index.modules[path].cls
    return policy if cls in policy.classes else ModuleWrap(policy.classes + (cls,))


@st.composite
def _wrap_plans(draw: Any, spec: CaseSpec, apis: Any, use_orig_params: Any, kinds: tuple, allow_ignored: bool) -> WrapPlan:
    choices = PlanChoices(draw, apis, use_orig_params, kinds, allow_ignored)
    return draw_plan(draw, TreeIndex(spec.tree, spec.classes), spec.shared, spec.ties, choices)


def wrap_plans(
    spec: CaseSpec,
    *,
    apis: SearchStrategy[str] = st.just("fsdp1"),
    use_orig_params: SearchStrategy[bool] = st.booleans(),
    policies: Iterable | None = None,
    allow_ignored: bool = True,
) -> SearchStrategy[WrapPlan]:
    """A WrapPlan for ``spec`` (its own plan is ignored): API from ``apis``,
    use_orig_params from ``use_orig_params``, a policy of one of ``policies``
    (see :func:`policies`), and, with ``allow_ignored``, sometimes 1..2
    ignored non-root modules (FSDP1 only) or 1..2 ignored parameter FQNs."""
    if not isinstance(spec, CaseSpec):
        raise InvalidArgument(f"spec={spec!r} must be a CaseSpec")
    check_strategy(apis, "apis")
    check_strategy(use_orig_params, "use_orig_params")
    check_bool(allow_ignored, "allow_ignored")
    return _wrap_plans(spec, apis, use_orig_params, check_policy_kinds(policies), allow_ignored)

