"""Cases where several FSDP1 units mix requires_grad, so that the order in
which the frozen-parameter check meets them is observable.

A freeze mask drawn on its own rarely makes two non-root units mixed (about
one case in twenty): the first-violator and warning-order promises of spec
source 000 then go mostly unchecked (issue 10: a traversal-order mutant
survived). Here the mask follows the units the oracle predicts: a few of
them get one parameter frozen each."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import assume, event, strategies as st
from hypothesis.strategies import SearchStrategy

from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.case.spec import CaseSpec, CustomWrap, ModuleWrap
from strategies._common import check_strategy, pick, pick_subset
from strategies.cases import case_specs
from strategies.freeze import apply_freeze_mask


@st.composite
def _several_mixed_units(draw: Any, use_orig_params: SearchStrategy[bool]) -> CaseSpec:
    # Object policies (the ones torch validates); no ties or shared modules:
    # the plain first-violator order, which other tests cover with them.
    spec = draw(case_specs(use_orig_params=use_orig_params, policies=[ModuleWrap, CustomWrap],
                           allow_ties=False, allow_shared=False, freeze=False))
    units = [u for u in predict_fsdp1(spec).units if u.path and len(u.managed) >= 2]
    assume(len(units) >= 2)
    chosen = pick_subset(draw, units, min_size=2, max_size=min(4, len(units)))
    event(f"mixed units: {len(chosen)}")
    mask = {pick(draw, sorted(u.managed)): False for u in chosen}
    return dataclasses.replace(spec, tree=apply_freeze_mask(spec.tree, mask))


def several_mixed_units(*, use_orig_params: SearchStrategy[bool] = st.booleans()) -> SearchStrategy[CaseSpec]:
    """FSDP1 CaseSpecs (ModuleWrap / CustomWrap) in which 2..4 non-root units
    each have one parameter frozen and the rest trainable."""
    check_strategy(use_orig_params, "use_orig_params")
    return _several_mixed_units(use_orig_params)
