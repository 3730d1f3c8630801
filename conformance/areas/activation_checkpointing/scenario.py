"""What a rank does for the activation_checkpointing area: AC applied, then
FSDP, a few SGD steps (conformance.areas.activation_checkpointing.adapter)."""

from __future__ import annotations

from conformance.areas.activation_checkpointing import adapter
from conformance.case.spec import CaseSpec


def activation_checkpointing(spec: CaseSpec) -> dict:
    return adapter.observe(spec).to_dict()
