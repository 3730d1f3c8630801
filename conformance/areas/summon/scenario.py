"""What a rank does for the summon area: FSDP1 and the
summon_full_params(recurse=False) workaround around the root's methods
(conformance.areas.summon.adapter)."""

from __future__ import annotations

from conformance.areas.summon import adapter
from conformance.case.spec import CaseSpec


def fsdp1_methods(spec: CaseSpec) -> dict:
    return adapter.observe(spec).to_dict()
