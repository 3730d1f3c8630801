"""What a rank does for the init_order area: the case's actions around
FSDP's lazy initialisation, then training (conformance.areas.init_order.adapter)."""

from __future__ import annotations

from conformance.areas.init_order import adapter
from conformance.case.spec import CaseSpec


def init_order(spec: CaseSpec) -> dict:
    return adapter.observe(spec).to_dict()
