"""The training-schedule scenario (MP-DTYPES, ACCUM; see conformance.adapters.schedule)."""

from __future__ import annotations

from typing import Any

from conformance.engine.scenarios import scenario
from conformance.case.spec import CaseSpec


def _comparable(value: dict) -> Any:
    from conformance.observations.schedule import ScheduleObservation

    return ScheduleObservation.from_dict(value).comparable()


@scenario("schedule", comparable=_comparable, preload=("conformance.adapters.schedule",))
def schedule(spec: CaseSpec) -> dict:
    """Optimizer steps with freeze changes, microbatches and mixed precision against fp32 single-process training."""
    from conformance.adapters import schedule as adapter

    return adapter.observe(spec).to_dict()
