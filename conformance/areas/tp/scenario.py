"""What a rank does for the tp area: parallelize a case over a (dp, tp) mesh,
fully_shard it over dp, train, clip and carry its state dicts
(conformance.areas.tp.adapter)."""

from __future__ import annotations

from conformance.areas.tp import adapter


def tp(spec) -> dict:
    return adapter.observe(spec).to_dict()
