"""INIT-DIVERGENT (FullyShardedDataParallel docstring: the gradients of the
per-rank forwards, or a clear error on every rank; never a hang), FSDP1's
backward form (thorough seed 241855, torch 2.13.0): Sequential(Linear 0,
Linear 1 frozen and a unit of its own, Linear 2), use_orig_params=True, rank
1's forward passes over Linear 0. The root's unit is only partly unused on
rank 1 (Linear 2 gives it a gradient), which FSDP1 handles; but Linear 1's
output needs a gradient on rank 0 only (through Linear 0), and FSDP1 hooks a
unit's pre-backward (the resharded unit's all-gather) on the outputs that
require grad: rank 0 all-gathers Linear 1 in backward while rank 1 enters the
root's reduce-scatter (TORCH_DISTRIBUTED_DEBUG=DETAIL), and every rank hangs.
That is fsdp1-rank-divergent-unit-hangs' mechanism, a collective one rank
never issues; the same hang without a frozen unit in that place is a failure.
Observations from one gloo run of the case (the corpus keeps the case and
test_corpus runs it on gloo)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from conformance.areas.init_order.observation import InitObservation
from conformance.areas.init_order.oracle import predict_init
from conformance.case.spec import CaseSpec
from conformance.run.runner import FAIL, KNOWN, evaluate

pytestmark = pytest.mark.selfcheck

DATA = json.loads((Path(__file__).parent / "data" / "init-divergent-fsdp1-frozen-unit-backward-one-rank.json").read_text())
CASE = CaseSpec.from_json(json.dumps(DATA["case"]))
FINDING = "fsdp1-rank-divergent-unit-hangs"
TAG = "skip:frozen-unit-backward-one-rank"


def _observations():
    return [InitObservation.from_dict({**o, "torch_version": "2.13.0+cpu"}) for o in DATA["observations"]]


def _with(case: CaseSpec, **requires_grad: bool) -> CaseSpec:
    """``case`` with the weights of the named top-level Linears given ``requires_grad``."""
    children = tuple(
        dataclasses.replace(c, params=tuple(dataclasses.replace(p, requires_grad=requires_grad.get(f"l{c.name}", p.requires_grad)) for p in c.params))
        for c in case.tree.children)
    return dataclasses.replace(case, tree=dataclasses.replace(case.tree, children=children))


def test_the_frozen_unit_s_one_rank_backward_is_the_rank_divergent_finding():
    assert CASE.init.skip == "0" and CASE.plan.use_orig_params and all(o.timed_out for o in _observations())
    tags = predict_init(CASE).tags
    assert TAG in tags and "skip:group-partly-used" in tags and not tags & {"skip:own-group", "skip:group-unused"}
    res = evaluate("INIT-DIVERGENT", CASE, _observations())
    assert res.verdict == KNOWN and {fid for _, fid in res.known} == {FINDING}, res.describe()


def test_a_frozen_parameter_of_a_trainable_unit_carries_the_gradient():
    # Linear 0 frozen too: with use_orig_params=True its forward value is a
    # view of the root's flat parameter, which requires grad (Linear 2), so
    # rank 0's Linear 1 output still needs a gradient (a torch-only torchrun
    # of this form hangs the same way)
    assert TAG in predict_init(_with(CASE, l0=False)).tags


def test_the_same_hang_without_that_frozen_unit_is_a_failure():
    # Linear 1 trainable: its output needs a gradient on both ranks (torch
    # then trains the case); a hang would be some other bug
    trainable = _with(CASE, l1=True)
    assert TAG not in predict_init(trainable).tags
    assert evaluate("INIT-DIVERGENT", trainable, _observations()).verdict == FAIL
    # rank 1 skipping Linear 2, after the frozen unit: Linear 0 feeds it on both ranks
    after = dataclasses.replace(CASE, init=dataclasses.replace(CASE.init, skip="2"))
    assert TAG not in predict_init(after).tags
    assert evaluate("INIT-DIVERGENT", after, _observations()).verdict == FAIL
