"""A total norm that overflows float32 (a 3-norm of gradients above ~1e13)
is a value like any other for the norm, and nothing to scale gradients by.
Seed 42 (ci, torch 2.13.0) FAILed TP-CLIP with "total norm inf,
single-process inf (norm_type 3)" and gradients that "differ from
single-process by nan": inf - inf is nan, which no tolerance admits, and
max_norm / inf is inf / inf. FSDP agreed with single-process clipping there;
the suite's comparison did not. Spec: the clip_grad_norm_ docstring (the
total norm of the gradients "viewed as a single vector"; clip_coef =
max_norm / (total_norm + 1e-6))."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from conformance.areas.clip.invariants import check_grads, check_norm
from conformance.areas.clip.observation import ClipObservation
from conformance.areas.clip.oracle import predict_clip
from conformance.areas.common.clipping import norm_agrees
from conformance.areas.common.observation import GradObservation
from conformance.case.spec import CaseSpec, ClipPlan
from conformance.run import runner

pytestmark = pytest.mark.selfcheck

DATA = Path(__file__).parent / "data"
# seed 42's shrunk case: a colwise Linear at the head of four, norm_type 3, two SGD steps
TP_CASE = CaseSpec.from_json((DATA / "tp-clip-norm-overflows.json").read_text())


def test_a_norm_agrees_with_an_overflowed_one_only_when_it_overflows_alike():
    assert norm_agrees(math.inf, math.inf, 1e-5, 1e-6) and norm_agrees(math.nan, math.nan, 1e-5, 1e-6)
    assert not norm_agrees(3.0e38, math.inf, 1e-5, 1e-6) and not norm_agrees(math.inf, 3.0e38, 1e-5, 1e-6)
    assert not norm_agrees(math.nan, math.inf, 1e-5, 1e-6) and not norm_agrees(-math.inf, math.inf, 1e-5, 1e-6)
    assert norm_agrees(2.0 + 1e-7, 2.0, 1e-5, 1e-6) and not norm_agrees(2.1, 2.0, 1e-5, 1e-6)


@pytest.mark.gloo
def test_tp_clip_compares_an_overflowed_norm_and_leaves_the_gradients(fault_pools):
    """Seed 42's case on two gloo ranks: the norms (inf on every rank and in
    the reference) agree, the gradients are not compared; a rank whose norm
    stayed finite, or a finite reference with a nan gradient, is still a FAIL."""
    from conformance.engine.worlds import Worlds

    engine = Worlds(fault_pools(2))
    try:
        obs = runner.observations(engine, TP_CASE, "tp")
    finally:
        engine.close()
    assert all(o.norm == math.inf and o.ref_norm == math.inf and o.norm_close for o in obs), [(o.norm, o.ref_norm) for o in obs]
    assert not obs[0].scale_finite
    res = runner.evaluate("TP-CLIP", TP_CASE, obs, [])
    assert res.verdict == "UNCHECKED" and "overflows float32" in res.unchecked, res
    finite = [dataclasses.replace(obs[0], norm=1.0e6, norm_close=False), obs[1]]
    res = runner.evaluate("TP-CLIP", TP_CASE, finite, [])
    assert res.verdict == "FAIL" and any("total norm 1e+06, single-process inf" in str(v) for v in res.violations), res
    grads = [dataclasses.replace(o, scale_finite=True, clipped_grads=tuple(dataclasses.replace(p, close=False) for p in o.clipped_grads))
             for o in obs]
    res = runner.evaluate("TP-CLIP", TP_CASE, grads, [])
    assert res.verdict == "FAIL" and any("clipped gradient differs" in str(v) for v in res.violations), res


def test_clip_grads_leaves_gradients_scaled_by_an_overflowed_norm():
    spec = dataclasses.replace(TP_CASE, tp=None, clip=ClipPlan(norm_type="3"))
    pred = predict_clip(spec)
    assert not pred.applicable, pred.applicable
    bad = (GradObservation("0.0.weight", False, False, False, math.nan, False),)
    obs = [ClipObservation(api="fsdp2", rank=r, world_size=2, backend="gloo", torch_version="2.13.0", norm=math.inf,
                           ref_norm=math.inf, norm_close=True, scale_finite=False, params=bad, clipped=("0.0.weight",))
           for r in range(2)]
    assert check_norm(spec, pred, obs) == []
    got = check_grads(spec, pred, obs[0])
    assert not isinstance(got, list) and "overflows float32" in got.reason, got
    # a finite scale: the same gradients are a violation
    got = check_grads(spec, pred, dataclasses.replace(obs[0], scale_finite=True))
    assert isinstance(got, list) and got and "gradient differs from single-process by nan" in got[0].message, got
    # an overflowed reference, a rank's norm finite: CLIP-NORM says so
    got = check_norm(spec, pred, [dataclasses.replace(obs[0], norm=5.0, norm_close=False), obs[1]])
    assert [v.invariant for v in got] == ["CLIP-NORM"] and "total norm 5, single-process inf" in got[0].message, got
