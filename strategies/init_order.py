"""Strategies for init_order cases (INIT-ORDER, INIT-META, INIT-SYNC,
INIT-DIVERGENT): when the user's actions happen around FSDP's lazy
initialisation, over the drawn trees, freeze masks and ties of either API."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.case.spec import INIT_ACTIONS, INIT_DTYPES, INIT_OPTIMIZERS, CaseSpec, InitPlan, replaced_parameter
from conformance.case.tree import walk
from conformance.strategies._common import maybe, pick
from conformance.strategies.cases import case_specs
from conformance.strategies.groups import fsdp2_case_specs
from conformance.strategies.training import fsdp1_trainable

_OPTIMIZERS = st.sampled_from(INIT_OPTIMIZERS)
_INITS = st.sampled_from(("plain", "meta", "sync"))
INIT_KINDS = ("order", "divergent")


@st.composite
def _init_specs(draw: Any, cases: SearchStrategy, api: str, kind: str) -> CaseSpec:
    # the choices that do not depend on the tree first, at fixed positions
    # (as strategies.clip): drawn after a tree they shrink to the simplest
    optimizer = draw(_OPTIMIZERS, label="optimizer")
    if kind == "divergent":
        spec = draw(cases)
        paths = [p for p, _ in walk(spec.tree) if p]
        assume(paths)
        skip = pick(draw, paths)
        return dataclasses.replace(spec, init=InitPlan(skip=skip, optimizer=optimizer), methods=(), calls=())
    init = draw(_INITS, label="init")
    actions = INIT_ACTIONS if api == "fsdp2" else INIT_ACTIONS[:2]
    before = tuple(draw(st.lists(st.sampled_from(actions), max_size=3), label="actions before the first forward"))
    after_forward = draw(st.booleans(), label="optimizer after the first forward")
    dtype = draw(st.sampled_from(INIT_DTYPES), label="to(dtype)") if api == "fsdp2" and maybe(draw, 1) else None
    replace = api == "fsdp2" and draw(st.booleans(), label="a parameter registered anew before lazy init")
    spec = draw(cases)
    # a model without parameters trains nothing: its trajectory compares
    # nothing (and DCP refuses its empty state dict: seed 12, "model
    # state_dict is empty", a check of DCP's, not of the order of actions)
    assume(any(m.params for _, m in walk(spec.tree)))
    if api == "fsdp1" and not spec.plan.use_orig_params:
        after_forward = False  # FSDP1's flat parameters are built at wrap time: no later optimizer to draw
    if replace and replaced_parameter(spec) is None:
        replace = False  # every parameter tied, shared or empty: none to replace
    plan = InitPlan(before=before, optimizer_after_forward=after_forward, dtype=dtype, meta=init == "meta", sync=init == "sync",
                    optimizer=optimizer, replace=replace)
    return dataclasses.replace(spec, init=plan, methods=(), calls=())


def init_specs(*, api: str = "fsdp2", kind: str = "order", max_modules: int = 8, max_depth: int = 3) -> SearchStrategy[CaseSpec]:
    """init_order cases for ``api``. ``kind="order"``: a drawn order of
    actions before the first forward (state_dict, get_model_state_dict; FSDP2
    also unshard() and unshard(async_op=True).wait()), the optimizer built
    before or after the first forward (FSDP1: after only with
    use_orig_params=True), FSDP2 sometimes model.to(float64) after sharding
    and sometimes a parameter registered anew before lazy init (InitPlan.replace),
    and the model built plainly, on the meta device (materialised after
    wrapping) or from a seed per rank (synchronised from rank 0).
    ``kind="divergent"``: one non-root module rank 1's forward passes over
    (no ties or shared modules, so that nothing else reaches it)."""
    if api not in ("fsdp1", "fsdp2"):
        raise InvalidArgument(f"api={api!r} must be 'fsdp1' or 'fsdp2'")
    if kind not in INIT_KINDS:
        raise InvalidArgument(f"kind={kind!r} must be one of {INIT_KINDS}")
    plain = kind == "divergent"
    if api == "fsdp2":
        cases = fsdp2_case_specs(max_modules=max_modules, max_depth=max_depth, methods=False, allow_ignored=False,
                                 allow_ties=not plain, allow_shared=not plain)
    else:
        # as PARITY's: FSDP1's recorded tie and shared-module findings make ranks hang in training
        cases = case_specs(max_modules=max_modules, max_depth=max_depth, allow_ignored=False, allow_shared=False,
                           allow_ties=not plain).filter(fsdp1_trainable)
    return _init_specs(cases, api, kind)
