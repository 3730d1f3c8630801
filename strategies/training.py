"""Strategies for training cases (PARITY): a few optimizer steps under either
API, FSDP2's reduction settings."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.areas.common.fsdp1_oracle import fsdp1_case_tags, predict_fsdp1
from conformance.areas.common.fsdp2_oracle import ITERATED_CONTAINERS, TORCH_CONTAINERS
from conformance.case.graph import ModelGraph
from conformance.case.spec import OPTIMIZERS, CaseSpec, TrainPlan
from conformance.strategies._common import check_bool, check_int
from conformance.strategies.cases import case_specs
from conformance.strategies.groups import fsdp2_case_specs

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
        cases = case_specs(max_modules=max_modules, max_depth=max_depth, allow_ignored=False, allow_shared=False).filter(fsdp1_trainable)
    return _training_specs(cases, train_plans(max_steps=max_steps, reductions=reductions))


def fsdp1_trainable(spec: CaseSpec, *, sequential_units: bool = True) -> bool:
    """An FSDP1 case the training areas can run: no tie split between units,
    no module under two names (recorded findings that corrupt FSDP1's
    collectives, so that ranks hang), and no unit that is torch's ModuleList
    or ModuleDict: the case iterates those rather than calling them, so FSDP1
    never all-gathers for them (outside what FSDP promises; the ranks then
    fail on their own shards and hang). A unit that is torch's Sequential is
    called through its FSDP1 wrapper (conformance.case.build.call_child), as
    a user's model calls it; ``sequential_units=False`` leaves it out too,
    for an oracle that does not model that call."""
    check_bool(sequential_units, "sequential_units")
    pred = predict_fsdp1(spec)
    g = ModelGraph(spec)
    iterated = ITERATED_CONTAINERS if sequential_units else TORCH_CONTAINERS
    containers = any(g.is_torch(g.resolve_module(u.path), iterated, exact=True) for u in pred.units)
    return "tie:cross-unit" not in fsdp1_case_tags(spec, pred) and not pred.shared_modules and not containers
