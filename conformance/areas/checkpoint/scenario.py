"""What a rank does for the checkpoint area: full state dicts, load paths,
and the two phases of a checkpoint round trip (save and load take the
checkpoint directory as ``dir``; conformance.areas.checkpoint.adapter)."""

from __future__ import annotations

from conformance.areas.checkpoint import adapter
from conformance.case.spec import CaseSpec


def ckpt_full(spec: CaseSpec) -> dict:
    """Wrap the case and take its full state dict (SD-FULL)."""
    return adapter.observe_full(spec).to_dict()


def ckpt_ties(spec: CaseSpec) -> dict:
    """Load a full state dict by the case's load path; are ties kept? (TIES-KEPT)"""
    return adapter.observe_ties(spec).to_dict()


def ckpt_save(spec: CaseSpec, dir: str) -> dict:
    return adapter.save(spec, dir)


def ckpt_load(spec: CaseSpec, dir: str) -> dict:
    return adapter.load(spec, dir)
