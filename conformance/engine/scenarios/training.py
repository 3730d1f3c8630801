"""The training scenario: a few optimizer steps under the case's API (FSDP1 or
FSDP2) against single-process training (conformance.adapters.training)."""

from __future__ import annotations

from typing import Any

from conformance.engine.scenarios import scenario
from conformance.case.spec import CaseSpec


def _comparable(value: dict) -> Any:
    from conformance.observations import TrainObservation

    return TrainObservation.from_dict(value).comparable()


@scenario("train", comparable=_comparable, preload=("conformance.adapters.training",))
def train(spec: CaseSpec) -> dict:
    """A few optimizer steps under the case's API against single-process training."""
    from conformance.case.model_case import ModelCase

    if isinstance(spec, ModelCase):  # a real model: conformance.adapters.targets
        from conformance.adapters import targets

        return targets.observe_train(spec).to_dict()
    from conformance.adapters import training as adapter

    return adapter.observe(spec).to_dict()
