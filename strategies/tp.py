"""Strategies for tensor-parallel cases (TP-*): a (dp, tp) mesh, a parallel
style on some of the drawn Linear, Embedding and LayerNorm leaves, mixed
precision, a few training steps and a clip, over the shared FSDP2 trees,
freeze masks, ties and shard groups."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import assume, event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.case.spec import CLIP_WAYS, NORM_TYPES, TP_MESHES, TP_OPTIMIZERS, TP_PRECISIONS, TP_STYLES, CaseSpec, TpPlan
from conformance.case.tree import join, walk
from conformance.strategies._common import maybe, pick
from conformance.strategies.freeze import apply_freeze_mask
from conformance.strategies.groups import fsdp2_case_specs

# the dim of each parameter a style shards over tp (conformance.areas.tp.oracle's TP_PLACEMENT, by dim)
_SHARDED_DIM = {("Linear", "colwise"): {"weight": 0, "bias": 0}, ("Linear", "rowwise"): {"weight": 1},
                ("Embedding", "colwise"): {"weight": 1}, ("Embedding", "rowwise"): {"weight": 0}}


def empties_a_tp_shard(m, style: str, tp: int) -> bool:
    """Whether ``style`` on leaf ``m`` leaves some tp rank an empty piece (a sharded dim smaller than tp)."""
    dims = _SHARDED_DIM.get((m.cls, style), {})
    return any(q.name in dims and q.shape[dims[q.name]] < tp for q in m.params)


@st.composite
def _tp_specs(draw: Any, cases: SearchStrategy, meshes: tuple[tuple[int, int], ...]) -> CaseSpec:
    # the choices that do not depend on the tree first, the 2-D mesh the simplest
    mesh = pick(draw, meshes)
    optimizer = pick(draw, TP_OPTIMIZERS)
    steps = 1 + draw(st.integers(0, 1))
    precision = TP_PRECISIONS[0] if not maybe(draw, 3) or not maybe(draw, 1) else pick(draw, TP_PRECISIONS[1:])
    norm_type = pick(draw, NORM_TYPES)
    foreach = draw(st.booleans())
    clip_all = not maybe(draw, 2)
    clip_way = pick(draw, CLIP_WAYS[:2])
    # an empty TP shard (a dim smaller than tp) sometimes: FSDP2 raises on it
    # (fsdp2-tp-empty-local-shard-chunk-cat), which would hide the rest
    allow_empty = not maybe(draw, 3)
    spec = draw(cases)
    tied = {t.module for t in spec.ties}
    owner = {join(p, q.name): p for p, m in walk(spec.tree) for q in m.params}
    tied |= {owner.get(t.source) for t in spec.ties}
    leaves = [(p, m) for p, m in walk(spec.tree) if m.cls in TP_STYLES and p not in tied and p]
    styles = []
    for path, m in leaves:
        options = [s for s in TP_STYLES[m.cls] if allow_empty or not empties_a_tp_shard(m, s, mesh[1])]
        if options and (not styles or maybe(draw, 2)):
            styles.append((path, pick(draw, options)))
    assume(styles)
    pairs: tuple[tuple[str, str], ...] = ()
    candidates = _pair_candidates(spec, tied, mesh[1])
    if candidates and maybe(draw, 3):
        # a transformer MLP's pattern: colwise then rowwise with the hidden
        # activation sharded between them (the rowwise leaf's in_features made
        # the colwise leaf's out_features)
        a, b = pick(draw, candidates)
        spec = dataclasses.replace(spec, tree=_with_in_features(spec.tree, b, _weight(spec, a)[0]))
        styles = [(p, s) for p, s in styles if p not in (a, b)] + [(a, "colwise"), (b, "rowwise")]
        pairs = ((a, b),)
        event("tp: colwise -> rowwise pair")
    styled = {path for path, _ in styles}
    styled_params = [join(p, q.name) for p, m in walk(spec.tree) if p in styled for q in m.params]
    if not any(q.requires_grad for p, m in walk(spec.tree) if p in styled for q in m.params) and maybe(draw, 2):
        # The shared freeze masks leave no styled parameter trainable in about
        # half the draws (41% nothing trainable at all): TP-PARITY, TP-CLIP
        # and TP-MP-DTYPE then have no TP gradient to compare. Two in three
        # such draws train the styled leaves; the rest keep them frozen
        # (TP-LAYOUT's requires_grad findings need frozen styled parameters).
        spec = dataclasses.replace(spec, tree=apply_freeze_mask(spec.tree, dict.fromkeys(styled_params, True), spec.ties))
        event("tp: frozen styled leaves made trainable")
    for _, s in styles:
        event(f"tp: style {s}")
    event(f"tp: mesh {mesh}")
    plan = TpPlan(tuple(mesh), tuple(styles), steps, optimizer, 0.05, precision, norm_type, foreach, clip_all, clip_way, pairs)
    return dataclasses.replace(spec, tp=plan, methods=(), calls=())


def _weight(spec: CaseSpec, path: str) -> tuple[int, ...]:
    return next(q.shape for p, m in walk(spec.tree) if p == path for q in m.params if q.name == "weight")


def _pair_candidates(spec: CaseSpec, tied: set, tp: int) -> list[tuple[str, str]]:
    """(first, second) sibling Linear leaves, no tie touching either, the
    first's out_features a multiple of tp (the hidden activation splits
    evenly: DTensor.from_local reads an uneven Shard(-1) piece as even)."""
    by_parent: dict[str, list[str]] = {}
    for p, m in walk(spec.tree):
        if p and m.cls == "Linear" and p not in tied and not m.children:
            by_parent.setdefault(p.rpartition(".")[0], []).append(p)
    out = []
    for kids in by_parent.values():
        for i, a in enumerate(kids):
            if _weight(spec, a)[0] % tp == 0:
                out += [(a, b) for b in kids[i + 1:]]
    return out


def _with_in_features(tree, path: str, n: int):
    """``tree`` with the Linear at ``path`` taking ``n`` input features."""
    head, _, rest = path.partition(".")
    children = []
    for c in tree.children:
        if c.name != head:
            children.append(c)
        elif rest:
            children.append(_with_in_features(c, rest, n))
        else:
            params = tuple(dataclasses.replace(q, shape=(q.shape[0], n)) if q.name == "weight" else q for q in c.params)
            children.append(dataclasses.replace(c, params=params))
    return dataclasses.replace(tree, children=tuple(children))


def tp_specs(*, worlds: tuple[int, ...] = (4, 2), max_modules: int = 8, max_depth: int = 3) -> SearchStrategy[CaseSpec]:
    """Tensor-parallel cases on a (dp, tp) mesh of one of ``worlds`` ranks
    ((2, 2) on 4; (1, 2), (2, 1) on 2): an FSDP2 case (:func:`fsdp2_case_specs`
    without methods or shared modules: groups with their reshard_after_forward,
    frozen and tied parameters) whose Linear / Embedding leaves take
    ColwiseParallel or RowwiseParallel and LayerNorm leaves SequenceParallel
    (at least one leaf, none a tie touches; sometimes a style that leaves a
    tp rank an empty piece; often, where two sibling Linear leaves allow it,
    a colwise -> rowwise pair whose hidden activation stays sharded, the
    second's in_features made the first's out_features), 1..2 steps of SGD or Adam, sometimes bf16 mixed
    precision, and a clip (clip_grad_norm_, or get_total_norm + clip_grads_with_norm_)
    of norm type 2, 1, 3 or inf, foreach or not, over every parameter or
    only the TP ones."""
    meshes = tuple(m for m in TP_MESHES if m[0] * m[1] in worlds)
    if not worlds or not meshes:
        raise InvalidArgument(f"worlds={worlds!r}: no mesh of {TP_MESHES} has that many ranks")
    cases = fsdp2_case_specs(max_modules=max_modules, max_depth=max_depth, methods=False, allow_shared=False)
    return _tp_specs(cases, meshes)
