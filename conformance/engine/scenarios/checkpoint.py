"""Scenarios for the checkpoint invariants (conformance.adapters.checkpoint):
full state dicts, load paths, and the two phases of a checkpoint round trip
(``ckpt-save`` and ``ckpt-load`` take the checkpoint directory as ``dir``)."""

from __future__ import annotations

from typing import Any

from conformance.engine.scenarios import scenario
from conformance.case.spec import CaseSpec

PRELOAD = ("conformance.adapters.checkpoint",)
# A round trip: save on the case's save world, load on its load world; the
# Worlds engine runs the two phases in one temporary directory.
PHASES = {"ckpt-roundtrip": ("ckpt-save", "ckpt-load")}


def _comparable(value: dict) -> Any:
    from conformance.observations.checkpoint import CkptObservation

    return CkptObservation.from_dict(value).comparable()


@scenario("ckpt-full", comparable=_comparable, preload=PRELOAD)
def ckpt_full(spec: CaseSpec) -> dict:
    """Wrap the case and take its full state dict (SD-FULL)."""
    from conformance.adapters import checkpoint as adapter

    return adapter.observe_full(spec).to_dict()


@scenario("ckpt-ties", comparable=_comparable, preload=PRELOAD)
def ckpt_ties(spec: CaseSpec) -> dict:
    """Load a full state dict by the case's load path; are ties kept? (TIES-KEPT)"""
    from conformance.adapters import checkpoint as adapter

    return adapter.observe_ties(spec).to_dict()


@scenario("ckpt-save", comparable=_comparable, preload=PRELOAD)
def ckpt_save(spec: CaseSpec, dir: str) -> dict:
    from conformance.adapters import checkpoint as adapter

    return adapter.save(spec, dir)


@scenario("ckpt-load", comparable=_comparable, preload=PRELOAD)
def ckpt_load(spec: CaseSpec, dir: str) -> dict:
    from conformance.adapters import checkpoint as adapter

    return adapter.load(spec, dir)
