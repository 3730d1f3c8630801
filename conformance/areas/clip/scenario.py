"""What a rank does for the clip area: one backward under the case's API,
its gradients clipped as the plan says (conformance.areas.clip.adapter)."""

from __future__ import annotations

from conformance.areas.clip import adapter
from conformance.case.spec import CaseSpec


def clip(spec: CaseSpec) -> dict:
    return adapter.observe(spec).to_dict()
