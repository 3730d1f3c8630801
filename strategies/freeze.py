"""Strategies for freeze masks: which parameters have requires_grad."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from conformance.case.spec import ModuleSpec, ParamSpec, TiedParam
from conformance.case.tree import join
from conformance.strategies._common import TreeIndex, check_kinds, check_tree, ints, pick, pick_subset

# Simplest first. "adapters": only parameters under a module named lora* or
# adapter* are trainable (LoRA-like); "biases": only parameters named bias;
# "frozen_subtrees": a few whole subtrees frozen, the rest trainable;
# "random": each parameter on its own.
FREEZE_KINDS = ("trainable", "frozen", "biases", "adapters", "frozen_subtrees", "random")


def draw_freeze_mask(draw: Any, index: TreeIndex, kind: str) -> dict[str, bool]:
    """A mask of ``kind`` for the tree ``index`` describes."""
    fqns = list(index.params)
    if kind == "trainable":
        return dict.fromkeys(fqns, True)
    if kind == "frozen":
        return dict.fromkeys(fqns, False)
    if kind == "biases":
        return {f: f.rpartition(".")[2] == "bias" for f in fqns}
    if kind == "adapters":
        return {f: index.is_adapter(index.param_owner[f]) for f in fqns}
    if kind == "frozen_subtrees":
        roots = pick_subset(draw, index.paths[1:] or [""], min_size=1, max_size=2)
        return {f: not any(r == "" or f.startswith(r + ".") for r in roots) for f in fqns}
    # random: one choice for the whole mask (bit i set: parameter i frozen), so
    # that it stays cheap for big trees and shrinks to all trainable.
    if not fqns:
        return {}
    bits = draw(ints((1 << len(fqns)) - 1))
    return {f: not (bits >> i) & 1 for i, f in enumerate(fqns)}


@st.composite
def _freeze_masks(draw: Any, tree: ModuleSpec, classes: tuple, kinds: tuple[str, ...]) -> dict[str, bool]:
    kind = pick(draw, kinds)
    event(f"freeze mask: {kind}")
    return draw_freeze_mask(draw, TreeIndex(tree, classes), kind)


def freeze_masks(tree: ModuleSpec, classes: tuple = (), *, kinds: Iterable[str] = FREEZE_KINDS) -> SearchStrategy[dict[str, bool]]:
    """{parameter FQN: requires_grad} for every parameter of ``tree`` (its own
    tree, ties aside), of one of ``kinds`` (see FREEZE_KINDS)."""
    check_tree(tree, classes)
    return _freeze_masks(tree, classes, check_kinds(kinds, "kinds", FREEZE_KINDS))


def apply_freeze_mask(tree: ModuleSpec, mask: Mapping[str, bool], ties: Iterable[TiedParam] = ()) -> ModuleSpec:
    """``tree`` with requires_grad from ``mask`` (FQNs it lacks keep theirs).
    A parameter a tie replaces takes its source's requires_grad, since the built
    model holds the source Parameter there."""
    mask = dict(mask)
    for t in ties:
        fqn = join(t.module, t.name)
        if fqn in mask and t.source in mask:
            mask[fqn] = mask[t.source]
    return _apply(tree, "", mask)


def _apply(m: ModuleSpec, path: str, mask: Mapping[str, bool]) -> ModuleSpec:
    params = tuple(
        p if mask.get(join(path, p.name), p.requires_grad) == p.requires_grad
        else ParamSpec(p.name, p.shape, not p.requires_grad)
        for p in m.params
    )
    children = tuple(_apply(c, join(path, c.name), mask) for c in m.children)
    if params == m.params and all(a is b for a, b in zip(children, m.children)):
        return m
    return ModuleSpec(m.name, m.cls, params, m.buffers, children)
