"""INIT-SYNC names the cause of a failed load (load_state_dict's first line
names only the module) and tags it, and "tie:same-module" marks two aliases
of one Parameter on one module, so that
fsdp2-set-model-state-dict-shared-module explains the broadcast of a root
holding proj0.weight as tied0 and tied1 (seed 34 of the ci profile, torch
2.13.0: rank 0 'tied1: ... in-place operations that require placement
changes', the other ranks 'Missing key(s) in state_dict: "tied1"'), and a
load error of another cause stays a FAIL."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.common.violations import tie_within_one_module
from conformance.areas.init_order.observation import InitObservation
from conformance.case.spec import CaseSpec, TiedParam
from conformance.run.runner import FAIL, KNOWN, evaluate

pytestmark = pytest.mark.selfcheck

# Model(proj0: Linear(1, 1)) with the root's tied0 and tied1 = proj0.weight, FSDP2, InitPlan(sync=True)
CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "init-sync-two-aliases-one-module.json").read_text())
LOAD = "RuntimeError: Error(s) in loading state_dict for FSDPModel:"
PLACEMENT = f"{LOAD} tied1: aten.copy_.default: in-place operations that require placement changes are not supported."
MISSING = f'{LOAD} Missing key(s) in state_dict: "tied1".'


def test_two_aliases_on_one_module_are_a_tie_within_one_module():
    assert tie_within_one_module(CASE)  # the root holds tied0 and tied1
    across = dataclasses.replace(CASE, ties=(TiedParam("", "tied0", "proj0.weight"),))  # one alias on another module
    assert not tie_within_one_module(across)


def _sync(errors: list[str], spec: CaseSpec = CASE):
    obs = [InitObservation(api="fsdp2", rank=r, world_size=len(errors), backend="gloo", torch_version="2.13.0", sync_error=e, failed=True)
           for r, e in enumerate(errors)]
    return evaluate("INIT-SYNC", spec, obs)


def test_the_broadcast_forms_are_the_finding():
    res = _sync([PLACEMENT, MISSING])
    assert res.verdict == KNOWN and {fid for _, fid in res.known} == {"fsdp2-set-model-state-dict-shared-module"}, res.describe()
    tags = {t for v, _ in res.known for t in v.tags}
    assert {"error:placement-change", "error:missing-key", "tie:same-module"} <= tags


def test_another_load_error_or_a_tie_across_modules_is_a_failure():
    other = f"{LOAD} size mismatch for proj0.weight: copying a param with shape torch.Size([2, 1])"
    assert _sync([other, other]).verdict == FAIL
    across = dataclasses.replace(CASE, ties=(TiedParam("", "tied0", "proj0.weight"),))
    assert _sync([PLACEMENT, MISSING], across).verdict == FAIL  # a Parameter tied across modules loads
