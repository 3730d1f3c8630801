"""What a rank does for the hsdp area: train a case over a (replicate,
shard) layout, beside flat FSDP and single-process training
(conformance.areas.hsdp.adapter)."""

from __future__ import annotations

from conformance.areas.hsdp import adapter


def hsdp(spec) -> dict:
    return adapter.observe(spec).to_dict()
