"""Strategies for shared submodules (one module under two names) and tied
parameters (one Parameter in two modules)."""

from __future__ import annotations

from typing import Any, Iterable

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from conformance.case.spec import ModuleSpec, SharedModule, TiedParam
from conformance.case.tree import join
from conformance.strategies._common import TreeIndex, check_int, check_kinds, check_tree, maybe, pick

# Where the second registration of a shared module is, relative to the first,
# simplest first: in the same parent (self.a is self.b); in a sibling of the
# module; in an ancestor other than its parent (one branch, two depths);
# anywhere else (another branch).
SHARED_KINDS = ("same_parent", "siblings", "ancestor", "other_branch")
# How the two modules of a tie relate, simplest first. "different_depths":
# neither is the other's parent (grandparent and grandchild, uncle and
# nephew); "cousins": same depth, different parents; "embedding_head": a
# Linear's weight is an Embedding's weight (the language-model tie).
TIE_KINDS = ("siblings", "parent_child", "same_module", "different_depths", "cousins", "embedding_head")


# ---- shared modules --------------------------------------------------------------


def shared_kind(index: TreeIndex, s: SharedModule) -> str:
    if index.parent[s.source] == s.parent:
        return "same_parent"
    if index.parent.get(s.parent) == index.parent[s.source]:
        return "siblings"
    if index.is_ancestor(s.parent, s.source):
        return "ancestor"
    return "other_branch"


def _shared_parent_ok(index: TreeIndex, path: str) -> bool:
    # Not a torch leaf (validate() lets one through, but a Linear's forward
    # would ignore the module) and not list-like (validate() forbids it).
    return index.kind[path] in ("Module", "ModuleDict") and (path in index.drawn or index.modules[path].cls == "ModuleDict")


def _shared_pairs(index: TreeIndex, kind: str) -> list[tuple[str, str]]:
    """(parent, source) pairs of ``kind`` on the spec's own tree."""
    nonroot = index.paths[1:]
    if kind == "same_parent":
        return [(index.parent[s], s) for s in nonroot if _shared_parent_ok(index, index.parent[s])]
    if kind == "siblings":
        return [
            (p, s)
            for p in nonroot if _shared_parent_ok(index, p)
            for s in index.children[index.parent[p]] if s != p
        ]
    if kind == "ancestor":
        out = []
        for s in nonroot:
            a = index.parent[index.parent[s]] if index.depth[s] >= 2 else None
            while a is not None:
                if _shared_parent_ok(index, a):
                    out.append((a, s))
                a = index.parent[a]
        return out
    return [
        (p, s)
        for p in index.paths if _shared_parent_ok(index, p)
        for s in nonroot
        if s != p and not index.is_ancestor(s, p) and not index.is_ancestor(p, s)
        and index.parent[s] != index.parent.get(p)
    ]


def _reaches(index: TreeIndex, extra: dict[str, list[str]], start: str, goal: str) -> bool:
    """Whether ``goal`` is ``start`` or below it, counting shared registrations."""
    stack, seen = [start], set()
    while stack:
        p = stack.pop()
        if p == goal:
            return True
        if p not in seen:
            seen.add(p)
            stack.extend(index.children[p])
            stack.extend(extra.get(p, ()))
    return False


def draw_shared(draw: Any, index: TreeIndex, *, min_size: int, max_size: int, kinds: tuple[str, ...]) -> tuple[SharedModule, ...]:
    out: list[SharedModule] = []
    extra: dict[str, list[str]] = {}
    tries = max_size + 2
    while len(out) < max_size and tries and (len(out) < min_size or maybe(draw, 1)):
        tries -= 1
        pairs = _first_pairs(_shared_pairs, index, pick(draw, kinds), kinds)
        if not pairs:
            break
        parent, source = pick(draw, pairs)
        # Earlier shared modules may already put the parent below the source.
        if extra and _reaches(index, extra, source, parent):
            continue
        extra.setdefault(parent, []).append(source)
        s = SharedModule(parent, _fresh(index, parent, "shared", out), source)
        event(f"shared module: {shared_kind(index, s)}")
        out.append(s)
    return tuple(out)


def _fresh(index: TreeIndex, path: str, prefix: str, added: list) -> str:
    """The first ``prefix<i>`` that neither the module nor an earlier draw
    (``added``, of SharedModule or TiedParam) uses there."""
    m = index.modules[path]
    taken = {x.name for x in m.params + m.buffers + m.children}
    taken.update(a.name for a in added if getattr(a, "parent", getattr(a, "module", None)) == path)
    i = 0
    while f"{prefix}{i}" in taken:
        i += 1
    return f"{prefix}{i}"


def _first_pairs(pairs_of: Any, index: TreeIndex, kind: str, kinds: tuple[str, ...]) -> list[tuple[str, str]]:
    """The pairs of ``kind``, else of the first of ``kinds`` the tree has."""
    for k in (kind, *kinds):
        pairs = pairs_of(index, k)
        if pairs:
            return pairs
    return []


@st.composite
def _shared_modules(draw: Any, tree: ModuleSpec, classes: tuple, min_size: int, max_size: int, kinds: tuple[str, ...]) -> tuple[SharedModule, ...]:
    return draw_shared(draw, TreeIndex(tree, classes), min_size=min_size, max_size=max_size, kinds=kinds)


def shared_modules(
    tree: ModuleSpec, classes: tuple = (), *, min_size: int = 0, max_size: int = 2, kinds: Iterable[str] = SHARED_KINDS
) -> SearchStrategy[tuple[SharedModule, ...]]:
    """Modules of ``tree`` registered a second time, as ``shared<i>`` under a
    drawn module or a ModuleDict (never a torch leaf or a list-like container),
    without cycles. ``kinds`` (see SHARED_KINDS) steers where. ``min_size``
    is best effort: a tree without room for that many gives fewer."""
    check_tree(tree, classes)
    check_int(min_size, "min_size", min_value=0)
    check_int(max_size, "max_size", min_value=min_size)
    return _shared_modules(tree, classes, min_size, max_size, check_kinds(kinds, "kinds", SHARED_KINDS))


# ---- tied parameters ---------------------------------------------------------------


def tie_kind(index: TreeIndex, t: TiedParam) -> str:
    source = index.param_owner[t.source]
    target = t.module
    if index.kind[source] == "Embedding" and index.kind[target] == "Linear":
        return "embedding_head"
    if source == target:
        return "same_module"
    if index.parent[source] == index.parent[target]:
        return "siblings"
    if index.parent[source] == target or index.parent[target] == source:
        return "parent_child"
    if index.depth[source] != index.depth[target]:
        return "different_depths"
    return "cousins"


def _tie_target_ok(index: TreeIndex, path: str) -> bool:
    return index.is_leaf(path) or index.can_hold_params(path)


def _tie_pairs(index: TreeIndex, kind: str) -> list[tuple[str, str]]:
    """(source module, target module) pairs of ``kind`` that may hold a tie."""
    shapes = {p: {q.shape for q in m.params} for p, m in index.modules.items()}

    def ok(s: str, t: str) -> bool:
        return bool(shapes[s]) and _tie_target_ok(index, t) and (index.can_hold_params(t) or bool(shapes[s] & shapes[t]))

    paths = index.paths
    if kind == "same_module":
        return [(p, p) for p in paths if ok(p, p)]
    if kind == "siblings":
        return [(s, t) for kids in index.children.values() for s in kids for t in kids if s != t and ok(s, t)]
    if kind == "parent_child":
        return [pair for c in paths[1:] for pair in ((index.parent[c], c), (c, index.parent[c])) if ok(*pair)]
    if kind == "embedding_head":
        return [
            (s, t)
            for s in paths if index.kind[s] == "Embedding"
            for t in paths if index.kind[t] == "Linear" and index.modules[t].params[0].shape in shapes[s]
        ]
    depth, parent = index.depth, index.parent
    if kind == "cousins":
        return [(s, t) for s in paths for t in paths if depth[s] == depth[t] and parent[s] != parent[t] and ok(s, t)]
    return [
        (s, t)
        for s in paths for t in paths
        if depth[s] != depth[t] and parent[s] != t and parent[t] != s and ok(s, t)
    ]


def draw_ties(draw: Any, index: TreeIndex, *, min_size: int, max_size: int, kinds: tuple[str, ...]) -> tuple[TiedParam, ...]:
    out: list[TiedParam] = []
    targets: set[str] = set()  # FQNs a tie replaces or adds
    sources: set[str] = set()
    tries = max_size + 2 if index.params else 0
    while len(out) < max_size and tries and (len(out) < min_size or maybe(draw, 1)):
        tries -= 1
        pairs = _first_pairs(_tie_pairs, index, pick(draw, kinds), kinds)
        if not pairs:
            break
        source, target = pick(draw, pairs)
        head = index.kind[source] == "Embedding" and index.kind[target] == "Linear"
        tm = index.modules[target]
        # A source is never itself replaced, nor a replaced parameter a source:
        # no chains, whose meaning would hang on the order ties are applied in.
        free = [f for f in (join(source, p.name) for p in index.modules[source].params) if f not in targets]
        slots: list[tuple[str, str]] = []
        for p in tm.params[:1] if head else tm.params:
            fqn = join(target, p.name)
            if fqn not in targets and fqn not in sources:
                slots += [(p.name, f) for f in free if f != fqn and index.params[f].shape == p.shape]
        if index.can_hold_params(target):
            new = _fresh(index, target, "tied", out)
            slots += [(new, f) for f in free]
        if not slots:
            continue
        name, fqn = pick(draw, slots)
        t = TiedParam(target, name, fqn)
        targets.add(join(target, name))
        sources.add(fqn)
        event(f"tie: {tie_kind(index, t)}")
        out.append(t)
    return tuple(out)


@st.composite
def _ties(draw: Any, tree: ModuleSpec, classes: tuple, min_size: int, max_size: int, kinds: tuple[str, ...]) -> tuple[TiedParam, ...]:
    return draw_ties(draw, TreeIndex(tree, classes), min_size=min_size, max_size=max_size, kinds=kinds)


def ties(
    tree: ModuleSpec, classes: tuple = (), *, min_size: int = 0, max_size: int = 2, kinds: Iterable[str] = TIE_KINDS
) -> SearchStrategy[tuple[TiedParam, ...]]:
    """Tied parameters of ``tree``: a parameter of a torch leaf or a drawn
    module replaced by another of the same shape, or a new ``tied<i>``
    attribute of a drawn module holding an existing parameter. No chains (a
    tie's source is never replaced) and no parameter replaced twice. ``kinds``
    (see TIE_KINDS) steers how the two modules relate. ``min_size`` is best
    effort: a tree without room for that many gives fewer."""
    check_tree(tree, classes)
    check_int(min_size, "min_size", min_value=0)
    check_int(max_size, "max_size", min_value=min_size)
    return _ties(tree, classes, min_size, max_size, check_kinds(kinds, "kinds", TIE_KINDS))
