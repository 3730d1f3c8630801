"""Strategies for activation-checkpointing cases (AC-PARITY, AC-STATE-DICT,
AC-ALLGATHER): which modules are checkpointed, and how, over the drawn
trees, freeze masks, ties and plans of either API."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.case.spec import AC_KINDS, ActivationCheckpointPlan, CaseSpec
from conformance.strategies._common import TreeIndex, check_bool, pick_subset
from conformance.strategies.cases import case_specs
from conformance.strategies.groups import fsdp2_case_specs
from conformance.strategies.training import fsdp1_trainable

_KINDS = {"fsdp2": st.sampled_from(AC_KINDS), "fsdp1": st.sampled_from(tuple(k for k in AC_KINDS if k != "composable"))}
_STEPS = st.integers(1, 2)


def _targets(index: TreeIndex) -> list[str]:
    """Modules a case may checkpoint: drawn, non-root modules whose forward
    the case calls (not torch's containers, which are walked, nor its
    leaves, whose inputs the parent's forward shapes for them)."""
    return [p for p in index.paths if p and index.can_hold_params(p)]


@st.composite
def _ac_specs(draw: Any, cases: SearchStrategy, api: str) -> CaseSpec:
    # the tree-independent choices first, at fixed positions (strategies.policies.PlanChoices)
    kind = draw(_KINDS[api], label="checkpointing kind")
    steps = draw(_STEPS, label="steps")
    spec = draw(cases)
    index = TreeIndex(spec.tree, spec.classes)
    candidates = _targets(index)
    # nothing to checkpoint in this tree: a case without AC would check nothing
    assume(bool(candidates))
    chosen = pick_subset(draw, candidates, min_size=1, max_size=2)
    targets = tuple(t for t in chosen if not any(o != t and t.startswith(o + ".") for o in chosen))
    plan = ActivationCheckpointPlan(kind, targets, steps)
    return dataclasses.replace(spec, activation_checkpoint=plan, methods=(), calls=())


def ac_specs(*, api: str = "fsdp2", max_modules: int = 10, max_depth: int = 3, freeze: bool = True) -> SearchStrategy[CaseSpec]:
    """Activation-checkpointing cases for ``api``: FSDP2 (:func:`fsdp2_case_specs`
    without methods or shared modules) or FSDP1 (either use_orig_params, any
    policy), ties and (with ``freeze``) freeze masks included, nothing
    ignored; 1..2 drawn modules checkpointed (none inside another; inside,
    around or the same as FSDP units / groups, as the plan falls) by
    checkpoint_wrapper (non-reentrant, reentrant), torch.utils.checkpoint,
    selective AC or (FSDP2) the composable checkpoint; 1..2 SGD steps."""
    if api not in ("fsdp1", "fsdp2"):
        raise InvalidArgument(f"api={api!r} must be 'fsdp1' or 'fsdp2'")
    check_bool(freeze, "freeze")
    if api == "fsdp2":
        cases = fsdp2_case_specs(max_modules=max_modules, max_depth=max_depth, methods=False, allow_shared=False, freeze=freeze)
    else:
        cases = case_specs(max_modules=max_modules, max_depth=max_depth, allow_ignored=False, allow_shared=False,
                           freeze=freeze).filter(fsdp1_trainable)
    return _ac_specs(cases, api)
