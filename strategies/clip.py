"""Strategies for clipping cases (CLIP-NORM, CLIP-GRADS): a clipping plan
over the drawn trees, freeze masks, ties and ignored parameters of either API."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.case.spec import CLIP_FRACTIONS, CLIP_PRECISIONS, NORM_TYPES, CaseSpec, ClipPlan
from conformance.case.tree import walk
from conformance.strategies._common import check_bool, maybe, pick
from conformance.strategies.cases import case_specs
from conformance.strategies.groups import fsdp2_case_specs
from conformance.strategies.training import fsdp1_trainable

_NORMS = st.sampled_from(NORM_TYPES)
_FRACTIONS = st.sampled_from(CLIP_FRACTIONS)
_WAYS = st.sampled_from(("clip_grad_norm_", "get_total_norm"))
_FOREACH = st.sampled_from((None, True, False))


@st.composite
def _clip_specs(draw: Any, cases: SearchStrategy, api: str) -> CaseSpec:
    # The choices that do not depend on the tree first, at fixed positions
    # (as strategies.policies.PlanChoices): drawn after a tree of varying
    # size they are often replayed as the simplest value, and the inf norm
    # (where the APIs differ most) would then be rare.
    norm = draw(_NORMS, label="norm_type")
    fraction = draw(_FRACTIONS, label="max_norm fraction")
    # mixed precision on about half the cases (FSDP1's keep_low_precision_grads its own)
    precisions = [p for p in CLIP_PRECISIONS if api == "fsdp1" or not p.keep_low_precision_grads]
    precision = draw(st.sampled_from((None, *precisions)) if maybe(draw, 1) else st.none(), label="precision")
    way, foreach, whole = "fsdp1-method", None, True
    if api == "fsdp2":
        way = draw(_WAYS, label="way")
        foreach = draw(_FOREACH, label="foreach")
        whole = not maybe(draw, 1)
    spec = draw(cases)
    subset = None
    if not whole:  # one module's parameters (a per-group clip), the root's included
        subset = pick(draw, [p for p, _ in walk(spec.tree)])
    if spec.plan.ignored_params or spec.plan.ignored_modules:
        precision = None  # FSDP casts no ignored parameter: bf16 activations would meet fp32 weights (the user's error)
    return dataclasses.replace(spec, clip=ClipPlan(norm, way, foreach, fraction, subset, precision), methods=(), calls=())


def clip_specs(*, api: str = "fsdp2", max_modules: int = 10, max_depth: int = 3, allow_ignored: bool = True) -> SearchStrategy[CaseSpec]:
    """Clipping cases for ``api``: FSDP2 (:func:`fsdp2_case_specs` without
    methods; with ``allow_ignored`` sometimes ignored parameters) clipped by
    torch.nn.utils.clip_grad_norm_ or get_total_norm + clip_grads_with_norm_,
    foreach None / True / False, every parameter or one module's; FSDP1
    (either use_orig_params, any policy, ignored modules or parameters with
    ``allow_ignored``) by its clip_grad_norm_ method. Norm type 2, 1, 3 or
    inf; max_norm a fraction of the single-process norm (0.5, 0.1: clipping
    bites; 2.0: it leaves the gradients alone); on about half the cases
    mixed precision (CLIP_PRECISIONS: bf16 compute, the reduction in bf16
    or fp32, FSDP1's gradients kept in bf16)."""
    if api not in ("fsdp1", "fsdp2"):
        raise InvalidArgument(f"api={api!r} must be 'fsdp1' or 'fsdp2'")
    check_bool(allow_ignored, "allow_ignored")
    if api == "fsdp2":
        cases = fsdp2_case_specs(max_modules=max_modules, max_depth=max_depth, methods=False, allow_ignored=allow_ignored)
    else:
        # as PARITY's: FSDP1's recorded tie and shared-module findings make ranks hang in training
        cases = case_specs(max_modules=max_modules, max_depth=max_depth, allow_ignored=allow_ignored, allow_shared=False).filter(fsdp1_trainable)
    return _clip_specs(cases, api)
