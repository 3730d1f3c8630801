"""ColwiseParallel on a Linear with out_features 1 on a tp mesh dim of size 1:
the backward raises "would remove or reshape sharded dimension 1" (DTensor's
view of the bias gradient), with or without fully_shard. Seed 46 (ci, tp
area, 2026-12-03) FAILed TP-PARITY on it once the tp strategy trained its
styled leaves; the finding tp-colwise-size-one-out-features-view-backward
explains it there, and only there. Spec: the ColwiseParallel docstring; TP-PARITY."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.tp.invariants import _error_tag
from conformance.case.spec import CaseSpec
from conformance.run import known, runner

pytestmark = pytest.mark.selfcheck

CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "tp-colwise-size-one-out-features.json").read_text())
FINDING = "tp-colwise-size-one-out-features-view-backward"
ERROR = "RuntimeError: This operation would remove or reshape sharded dimension 1, which requires redistribution."


def test_the_error_is_tagged_by_its_mechanism():
    assert _error_tag(ERROR) == "error:view-sharded-dim"
    assert _error_tag("RuntimeError: something else") == "error:other"


@pytest.mark.gloo
def test_seed_46s_case_is_known_and_another_error_or_mesh_is_not(fault_pools):
    from conformance.engine.worlds import Worlds

    assert CASE.tp.mesh == (2, 1) and CASE.tp.styles == (("proj0", "colwise"),)
    engine = Worlds(fault_pools(2))
    try:
        obs = runner.observations(engine, CASE, "tp")
    finally:
        engine.close()
    kf = known.load()
    res = runner.evaluate("TP-PARITY", CASE, obs, kf)
    assert res.verdict == "KNOWN" and {k for _, k in res.known} == {FINDING}, res
    # the same observation with another error, or tagged as a tp mesh of 2: not this finding
    other = [dataclasses.replace(o, step_error="RuntimeError: something else went wrong") for o in obs]
    assert runner.evaluate("TP-PARITY", CASE, other, kf).verdict == "FAIL"
    wide = dataclasses.replace(CASE, tp=dataclasses.replace(CASE.tp, mesh=(1, 2)))
    res = runner.evaluate("TP-PARITY", wide, obs, kf)
    assert FINDING not in {k for _, k in res.known}, res
