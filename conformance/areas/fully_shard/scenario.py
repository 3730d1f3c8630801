"""What a rank does for the fully_shard area: fully_shard the case, register
and call its forward methods, run backward (conformance.areas.fully_shard.adapter)."""

from __future__ import annotations

from conformance.areas.fully_shard import adapter
from conformance.case.model_case import ModelCase


def fsdp2(case) -> dict:
    """A generated case, or a real model's (its own forward and methods)."""
    if isinstance(case, ModelCase):
        return adapter.observe_fsdp2(case).to_dict()
    return adapter.observe(case).to_dict()
