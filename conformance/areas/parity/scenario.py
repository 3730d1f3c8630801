"""What a rank does for the parity area: a few optimizer steps under the
case's API (FSDP1 or FSDP2) against single-process training
(conformance.areas.parity.adapter)."""

from __future__ import annotations

from conformance.areas.parity import adapter
from conformance.case.model_case import ModelCase


def train(case) -> dict:
    """A generated case, or a real model's (the target's loss on its inputs)."""
    if isinstance(case, ModelCase):
        return adapter.observe_train(case).to_dict()
    return adapter.observe(case).to_dict()
