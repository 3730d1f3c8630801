"""FSDP1 scenarios: wrap the case with FullyShardedDataParallel and observe it
(conformance.adapters.fsdp1), and the summon_full_params workaround around the
root's forward methods (conformance.adapters.fsdp1_methods)."""

from __future__ import annotations

from typing import Any

from conformance.engine.scenarios import scenario
from conformance.case.spec import CaseSpec


def _observation_comparable(value: dict) -> Any:
    from conformance.observations import Observation

    return Observation.from_dict(value).comparable()


@scenario("fsdp1", comparable=_observation_comparable, preload=("conformance.adapters.fsdp1",))
def fsdp1(spec: CaseSpec) -> dict:
    """Wrap the case with FSDP1 and observe it (conformance.adapters.fsdp1)."""
    from conformance.adapters import fsdp1 as adapter

    return adapter.observe(spec).to_dict()


@scenario("fsdp1-structure", comparable=_observation_comparable, preload=("conformance.adapters.fsdp1",))
def fsdp1_structure(spec: CaseSpec) -> dict:
    """As fsdp1, without state_dict() (the invariants that do not read it)."""
    from conformance.adapters import fsdp1 as adapter

    return adapter.observe(spec, with_state_dict=False).to_dict()


def _methods_comparable(value: dict) -> Any:
    from conformance.observations import FSDP2Observation  # the workaround reports in FSDP2's shape

    return FSDP2Observation.from_dict(value).comparable()


@scenario("fsdp1-methods", comparable=_methods_comparable, preload=("conformance.adapters.fsdp1_methods",))
def fsdp1_methods(spec: CaseSpec) -> dict:
    """FSDP1 and the summon_full_params(recurse=False) workaround around the root's methods."""
    from conformance.adapters import fsdp1_methods as adapter

    return adapter.observe(spec).to_dict()
