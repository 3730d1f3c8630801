"""What a rank does for the comm area: the plan's iterations under FSDP1
or FSDP2, recording every collective (conformance.areas.comm.adapter)."""

from __future__ import annotations

from conformance.areas.comm import adapter
from conformance.case.spec import CaseSpec


def comm(spec: CaseSpec) -> dict:
    return adapter.observe(spec).to_dict()
