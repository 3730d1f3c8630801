"""FSDP2 scenarios: fully_shard the case, register and call its forward
methods (conformance.adapters.fsdp2)."""

from __future__ import annotations

from typing import Any

from conformance.engine.scenarios import scenario
from conformance.case.spec import CaseSpec


def _comparable(value: dict) -> Any:
    from conformance.observations import FSDP2Observation

    return FSDP2Observation.from_dict(value).comparable()


@scenario("fsdp2", comparable=_comparable, preload=("conformance.adapters.fsdp2",))
def fsdp2(spec: CaseSpec) -> dict:
    """fully_shard the case, register and call its forward methods (conformance.adapters.fsdp2)."""
    from conformance.case.model_case import ModelCase

    if isinstance(spec, ModelCase):  # a real model: conformance.adapters.targets
        from conformance.adapters import targets

        return targets.observe_fsdp2(spec).to_dict()
    from conformance.adapters import fsdp2 as adapter

    return adapter.observe(spec).to_dict()
