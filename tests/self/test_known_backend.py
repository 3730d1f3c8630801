"""The value-comparing invariants tag their violations with the process
group's backend, so a known failure of one backend's collectives
(fsdp2-gloo-reduce-scatter-avg-sums: torch 2.8.0's gloo reduce_scatter sums
for ReduceOp.AVG) matches there and nowhere else. That the invariants put
the tag on real violations: tests/self/test_faults_fsdp2.py (values in a gloo
pool)."""

from __future__ import annotations

import dataclasses

import pytest

from conformance import known
from conformance.violation import Violation

pytestmark = pytest.mark.selfcheck

FINDING = "fsdp2-gloo-reduce-scatter-avg-sums"


def _finding() -> known.KnownFailure:
    return next(k for k in known.load() if k.id == FINDING)


def _retag(v: Violation, backend: str) -> Violation:
    tags = {t for t in v.tags if not t.startswith("backend:")} | {f"backend:{backend}"}
    return dataclasses.replace(v, tags=frozenset(tags))


@pytest.mark.parametrize("invariant,tags,matched", [
    ("MP-DTYPES", {"api:fsdp2", "reduce:float32", "kind:grad"}, True),
    ("MP-DTYPES", {"api:fsdp2", "reduce:bfloat16", "kind:param"}, True),
    ("MP-DTYPES", {"api:fsdp2", "reduce:float16", "kind:grad"}, False),  # SUM then divide: right on 2.8.0
    ("MP-DTYPES", {"api:fsdp1", "reduce:float32", "kind:grad"}, False),
    ("MP-DTYPES", {"api:fsdp2", "reduce:float32", "kind:grad-dtype"}, False),
    ("PARITY", {"api:fsdp1", "kind:param"}, False),
    ("PARITY", {"api:fsdp2", "kind:raised"}, False),
    ("FSDP2-FROZEN", {"api:fsdp2", "kind:frozen-grad"}, False),
    ("FWD-PARITY", {"api:fsdp2", "kind:output"}, False),
])
def test_the_finding_matches_only_gloo_value_mismatches(invariant, tags, matched):
    k = _finding()
    v = Violation(invariant, "m", frozenset(tags | {"backend:gloo"}))
    assert k.matches_tags(v) is matched
    assert k.matches(v, "2.8.0+cu128") is matched and not k.matches(v, "2.9.1+cu128")  # the measured range
    assert not k.matches_tags(_retag(v, "nccl"))
    assert not k.matches_tags(Violation(invariant, "m", frozenset(tags)))  # no backend tag (an older baseline): no match
