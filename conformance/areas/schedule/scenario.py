"""What a rank does for the schedule area: optimizer steps with freeze
changes, microbatches and mixed precision against fp32 single-process
training (conformance.areas.schedule.adapter)."""

from __future__ import annotations

from conformance.areas.schedule import adapter
from conformance.case.spec import CaseSpec


def schedule(spec: CaseSpec) -> dict:
    return adapter.observe(spec).to_dict()
