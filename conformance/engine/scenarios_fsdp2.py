"""Scenarios for FSDP2, user forward methods and training parity (the
adapters do the work; see conformance.adapters.fsdp2, .fsdp1_methods, .training)."""

from __future__ import annotations

from typing import Any

from conformance.engine.scenarios import scenario
from conformance.spec import CaseSpec


def _comparable(kind: str):
    def comparable(value: dict) -> Any:
        from conformance import observation_fsdp2 as o

        cls = o.TrainObservation if kind == "train" else o.FSDP2Observation
        return cls.from_dict(value).comparable()

    return comparable


@scenario("fsdp2", comparable=_comparable("fsdp2"), preload=("conformance.adapters.fsdp2",))
def fsdp2(spec: CaseSpec) -> dict:
    """fully_shard the case, register and call its forward methods (conformance.adapters.fsdp2)."""
    from conformance.model_case import ModelCase

    if isinstance(spec, ModelCase):
        from conformance.adapters import targets

        return targets.observe_fsdp2(spec).to_dict()
    from conformance.adapters import fsdp2 as adapter

    return adapter.observe(spec).to_dict()


@scenario("fsdp1-methods", comparable=_comparable("fsdp2"), preload=("conformance.adapters.fsdp1_methods",))
def fsdp1_methods(spec: CaseSpec) -> dict:
    """FSDP1 and the summon_full_params(recurse=False) workaround around the root's methods."""
    from conformance.adapters import fsdp1_methods as adapter

    return adapter.observe(spec).to_dict()


@scenario("train", comparable=_comparable("train"), preload=("conformance.adapters.training",))
def train(spec: CaseSpec) -> dict:
    """A few optimizer steps under the case's API against single-process training."""
    from conformance.model_case import ModelCase

    if isinstance(spec, ModelCase):
        from conformance.adapters import targets

        return targets.observe_train(spec).to_dict()
    from conformance.adapters import training as adapter

    return adapter.observe(spec).to_dict()
