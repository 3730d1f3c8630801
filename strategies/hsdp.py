"""Strategies for HSDP cases (HSDP-*): a (replicate, shard) layout, the way
it is given (FSDP2's 2-D mesh; FSDP1's device_mesh or process-group pair
with HYBRID_SHARD or _HYBRID_SHARD_ZERO2) and a few training steps, over
the shared trees, freeze masks, ties and wrap plans of either API."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.case.spec import HSDP_MESHES, HSDP_OPTIMIZERS, HSDP_STRATEGIES, CaseSpec, CustomWrap, HsdpPlan
from conformance.strategies._common import ints, pick
from conformance.strategies.cases import case_specs
from conformance.strategies.groups import fsdp2_case_specs
from conformance.strategies.training import fsdp1_trainable


@st.composite
def _hsdp_specs(draw: Any, cases: SearchStrategy, api: str, meshes: tuple[tuple[int, int], ...]) -> CaseSpec:
    # the choices that do not depend on the tree first, at fixed positions
    # (as strategies.policies.PlanChoices), the 2-D mesh the simplest
    mesh = pick(draw, meshes)
    way, strategy = "fsdp2-mesh", "HYBRID_SHARD"
    if api == "fsdp1":
        way = pick(draw, ("fsdp1-mesh", "fsdp1-pg"))
        strategy = pick(draw, HSDP_STRATEGIES)
    optimizer = pick(draw, HSDP_OPTIMIZERS)
    steps = 1 + draw(ints(2))
    spec = draw(cases)
    pol = spec.plan.policy
    if isinstance(pol, CustomWrap) and pol.kwargs:  # the hybrid strategy is the plan's, for every unit
        spec = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, policy=CustomWrap(pol.targets)))
    event(f"hsdp: {way} mesh {mesh}")
    return dataclasses.replace(spec, hsdp=HsdpPlan(tuple(mesh), way, strategy, steps, optimizer), methods=(), calls=())


def hsdp_specs(*, api: str = "fsdp2", worlds: tuple[int, ...] = (4, 2), max_modules: int = 8, max_depth: int = 3) -> SearchStrategy[CaseSpec]:
    """HSDP cases for ``api`` on a mesh of one of ``worlds`` ranks ((2, 2),
    (4, 1), (1, 4) on 4; (2, 1), (1, 2) on 2): FSDP2 (:func:`fsdp2_case_specs`
    without methods: groups with their reshard_after_forward, frozen and
    tied parameters) over a 2-D mesh; FSDP1 (either use_orig_params, any
    policy; frozen and tied parameters) with HYBRID_SHARD or
    _HYBRID_SHARD_ZERO2 given a device_mesh or a process-group pair; 1..3
    steps of SGD or Adam."""
    if api not in ("fsdp1", "fsdp2"):
        raise InvalidArgument(f"api={api!r} must be 'fsdp1' or 'fsdp2'")
    meshes = tuple(m for m in HSDP_MESHES if m[0] * m[1] in worlds)
    if not worlds or not meshes:
        raise InvalidArgument(f"worlds={worlds!r}: no mesh of {HSDP_MESHES} has that many ranks")
    if api == "fsdp2":
        cases = fsdp2_case_specs(max_modules=max_modules, max_depth=max_depth, methods=False, allow_shared=False)
    else:
        # as PARITY's: FSDP1's recorded tie and shared-module findings make ranks hang in training
        cases = case_specs(max_modules=max_modules, max_depth=max_depth, allow_ignored=False, allow_shared=False).filter(fsdp1_trainable)
    return _hsdp_specs(cases, api, meshes)
