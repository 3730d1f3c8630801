"""The checkpoint invariants tag a case whose FSDP2 side (save or load) gives
fully_shard a container subclass with a forward, so that
fsdp2-rejects-container-subclass-with-forward explains its ValueError on the
releases that have that bug, and only there (release matrix, 2.10.0 gloo-w2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.checkpoint.invariants import case_tags
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation
from conformance.run import known

pytestmark = pytest.mark.selfcheck

# saved under FSDP1, loaded under FSDP2 (no groups: the ModelDict root is given to fully_shard)
CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "ckpt-container-subclass-fsdp2-load.json").read_text())


def _as_plain_module(spec: CaseSpec) -> CaseSpec:
    classes = tuple(dataclasses.replace(c, base="Module") if c.name == "ModelDict" else c for c in spec.classes)
    return dataclasses.replace(spec, classes=classes)


def test_the_fsdp2_load_side_of_a_container_subclass_is_tagged():
    assert CASE.plan.api == "fsdp1" and CASE.ckpt.load_plan.api == "fsdp2"
    assert "container-subclass" in case_tags(CASE)
    assert "container-subclass" not in case_tags(_as_plain_module(CASE))
    fsdp1_only = dataclasses.replace(CASE, ckpt=dataclasses.replace(CASE.ckpt, load_plan=CASE.plan))
    assert "container-subclass" not in case_tags(fsdp1_only)


def test_the_finding_explains_the_wrap_error_only_where_torch_has_the_bug():
    v = Violation("OPTIM-STATE", "rank 0: wrap raised ValueError: fully_shard does not support containers that do not implement forward",
                  frozenset(case_tags(CASE) | {"kind:raised", "error:ValueError", "phase:wrap"}))
    finding = next(k for k in known.load() if k.id == "fsdp2-rejects-container-subclass-with-forward")
    assert finding.matches(v, "2.10.0+cu128")
    assert not finding.matches(v, "2.13.0+cpu")
    plain = Violation(v.invariant, v.message, frozenset(case_tags(_as_plain_module(CASE)) | {"kind:raised", "error:ValueError"}))
    assert not finding.matches(plain, "2.10.0+cu128")
