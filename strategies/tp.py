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
    for _, s in styles:
        event(f"tp: style {s}")
    event(f"tp: mesh {mesh}")
    plan = TpPlan(tuple(mesh), tuple(styles), steps, optimizer, 0.05, precision, norm_type, foreach, clip_all, clip_way)
    return dataclasses.replace(spec, tp=plan, methods=(), calls=())


def tp_specs(*, worlds: tuple[int, ...] = (4, 2), max_modules: int = 8, max_depth: int = 3) -> SearchStrategy[CaseSpec]:
    """Tensor-parallel cases on a (dp, tp) mesh of one of ``worlds`` ranks
    ((2, 2) on 4; (1, 2), (2, 1) on 2): an FSDP2 case (:func:`fsdp2_case_specs`
    without methods or shared modules: groups with their reshard_after_forward,
    frozen and tied parameters) whose Linear / Embedding leaves take
    ColwiseParallel or RowwiseParallel and LayerNorm leaves SequenceParallel
    (at least one leaf, none a tie touches; sometimes a style that leaves a
    tp rank an empty piece), 1..2 steps of SGD or Adam, sometimes bf16 mixed
    precision, and a clip (clip_grad_norm_, or get_total_norm + clip_grads_with_norm_)
    of norm type 2, 1, 3 or inf, foreach or not, over every parameter or
    only the TP ones."""
    meshes = tuple(m for m in TP_MESHES if m[0] * m[1] in worlds)
    if not worlds or not meshes:
        raise InvalidArgument(f"worlds={worlds!r}: no mesh of {TP_MESHES} has that many ranks")
    cases = fsdp2_case_specs(max_modules=max_modules, max_depth=max_depth, methods=False, allow_shared=False)
    return _tp_specs(cases, meshes)
