"""What a rank does for the autowrap area: wrap the case with
FullyShardedDataParallel and observe it (conformance.areas.autowrap.adapter)."""

from __future__ import annotations

from conformance.areas.autowrap import adapter
from conformance.case.spec import CaseSpec


def fsdp1(spec: CaseSpec) -> dict:
    """Wrap the case with FSDP1 and observe it, state_dict() included."""
    return adapter.observe(spec).to_dict()


def fsdp1_structure(spec: CaseSpec) -> dict:
    """As fsdp1, without state_dict() (the invariants that do not read it)."""
    return adapter.observe(spec, with_state_dict=False).to_dict()
