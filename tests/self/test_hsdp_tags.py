"""HSDP-SYNC and HSDP-PARITY name the error of the rank that raised, not
rank 0's "another rank's sync raised" (which names no mechanism), and tag
it, so that fsdp2-set-model-state-dict-shared-module explains the broadcast
form where rank 0 loads and the other ranks miss a key (seed 22 of the
issue-20 areas, torch 2.13.0: the root holds one Parameter under two names,
on a (4, 1) mesh), and only that."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.areas.common.fsdp2_adapter import load_cause
from conformance.areas.hsdp.invariants import check_sync
from conformance.areas.hsdp.observation import HsdpObservation
from conformance.areas.hsdp.oracle import predict_hsdp
from conformance.case.spec import CaseSpec
from conformance.run import known

pytestmark = pytest.mark.selfcheck

# Model(proj0: Linear(1, 1)) with the root's tied0 and tied1 = proj0.weight, FSDP2 on a (4, 1) mesh
CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "hsdp-two-aliases-one-module.json").read_text())
MISSING = 'RuntimeError: Error(s) in loading state_dict for FSDPModel: Missing key(s) in state_dict: "tied1".'
FINDING = next(k for k in known.load() if k.id == "fsdp2-set-model-state-dict-shared-module")


def _sync(errors: list[str | None]):
    obs = [HsdpObservation(api="fsdp2", rank=r, world_size=4, backend="gloo", torch_version="2.13.0", sync_error=e)
           for r, e in enumerate(errors)]
    return check_sync(CASE, predict_hsdp(CASE), obs)


def test_the_sync_names_the_rank_that_raised_and_its_missing_key():
    (v,) = _sync(["another rank's sync raised", MISSING, MISSING, MISSING])
    assert "on rank 1" in v.message and '"tied1"' in v.message
    assert "error:missing-key" in v.tags and FINDING.matches(v, "2.13.0")
    (other,) = _sync(["another rank's sync raised", "RuntimeError: something else", None, None])
    assert "error:other" in other.tags and not FINDING.matches(other, "2.13.0")
    (nobody,) = _sync(["another rank's sync raised"] * 4)  # no rank said more: the message says so, no mechanism
    assert "another rank's sync raised" in nobody.message and not FINDING.matches(nobody, "2.13.0")


def test_load_cause_keeps_strict_loading_s_keys():
    class E(RuntimeError):
        pass

    e = E('Error(s) in loading state_dict for FSDPModel:\n\tMissing key(s) in state_dict: "tied1". ')
    assert load_cause(e) == ' Missing key(s) in state_dict: "tied1".'
    assert load_cause(RuntimeError("something else\nMissing key(s) in state_dict: x")) == ""  # not a load_state_dict error
