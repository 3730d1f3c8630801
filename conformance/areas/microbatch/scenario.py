"""What a rank does for the microbatch area: one step's microbatches under
FSDP2 with the schedule settings drawn for each (conformance.areas.microbatch.adapter)."""

from __future__ import annotations

from conformance.areas.microbatch import adapter
from conformance.case.spec import CaseSpec


def microbatch(spec: CaseSpec) -> dict:
    return adapter.observe(spec).to_dict()
