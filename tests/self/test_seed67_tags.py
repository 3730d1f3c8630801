"""Seed 67 of the ci profile (torch 2.13.0, gloo) FAILed three rows whose
deviations are recorded findings' own mechanisms, which the areas' tags did
not name:
- CKPT-RESHARD and OPTIM-STATE: the save's training raised "setStorage ...
  storage of size 0" on fully_shard([model0.proj2, model0.embed3]) with the
  frozen Embedding run last: fsdp2-frozen-list-group-freed-in-backward (the
  checkpoint area now tags the group and the freed-storage cause);
- TP-STATE-DICT: loading a full state dict into the root's tied0 and tied1
  (one (1, 1) Parameter under two names of one module) raised "in-place
  operations that require placement changes are not supported":
  fsdp2-set-model-state-dict-shared-module's one-element form (the tp area
  now names that error).
The same errors where the mechanism is absent match neither."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.checkpoint.observation import CkptObservation
from conformance.areas.tp.observation import TpObservation
from conformance.case.spec import CaseSpec
from conformance.run.runner import evaluate

pytestmark = pytest.mark.selfcheck

DATA = Path(__file__).parent / "data"
CKPT = CaseSpec.from_json((DATA / "ckpt-frozen-list-group-train.json").read_text())
TP = CaseSpec.from_json((DATA / "tp-one-element-tie-same-module.json").read_text())
# ci seed 104: the rerun form (the group registered twice, reshard_after_forward=False)
RERUN = CaseSpec.from_json((DATA / "ckpt-frozen-list-group-rerun-train.json").read_text())
FREED = ("RuntimeError: setStorage: sizes [2, 1], strides [1, 1], storage offset 0, and itemsize 4 requiring a storage "
         "size of 8 are out of bounds for storage of size 0")
PLACEMENT = ('RuntimeError: Error(s) in loading state_dict for FSDPModel: While copying the parameter named "tied1", '
             "whose dimensions in the model are torch.Size([1, 1]) and whose dimensions in the checkpoint are "
             'torch.Size([1, 1]), an exception occurred : ("aten.copy_.default: in-place operations that require '
             "placement changes are not supported. The input has placement (Shard(dim=0),)")


def _no_list_group(spec: CaseSpec) -> CaseSpec:
    return dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, groups=()))


def _ckpt(spec: CaseSpec, invariant: str):
    obs = [CkptObservation(kind="roundtrip", api="fsdp2", rank=r, world_size=2, backend="gloo", torch_version="2.13.0",
                           error=FREED, phase="train") for r in range(2)]
    return evaluate(invariant, spec, obs)


@pytest.mark.parametrize("invariant", ["CKPT-RESHARD", "OPTIM-STATE"])
def test_the_saves_training_over_a_freed_list_group_is_that_finding(invariant):
    res = _ckpt(CKPT, invariant)
    assert res.verdict == "KNOWN" and {fid for _, fid in res.known} == {"fsdp2-frozen-list-group-freed-in-backward"}, res.describe()
    other = _ckpt(_no_list_group(CKPT), invariant)  # no list group: not that mechanism
    assert other.verdict == "FAIL", other.describe()


@pytest.mark.parametrize("invariant", ["CKPT-RESHARD", "OPTIM-STATE"])
def test_the_saves_training_over_a_list_group_run_twice_is_that_findings_rerun_form(invariant):
    res = _ckpt(RERUN, invariant)
    assert res.verdict == "KNOWN" and {fid for _, fid in res.known} == {"fsdp2-frozen-list-group-freed-in-backward"}, res.describe()
    once = dataclasses.replace(RERUN, shared=())  # the group runs once: not that mechanism (it trains)
    assert _ckpt(once, invariant).verdict == "FAIL"
    assert _ckpt(_no_list_group(RERUN), invariant).verdict == "FAIL"


def _tp(spec: CaseSpec):
    obs = TpObservation(api="fsdp2", rank=0, world_size=4, backend="gloo", torch_version="2.13.0",
                        unsharded_keys=("proj0.weight", "embed1.weight"), sd_errors=(("to-flat", PLACEMENT),))
    return evaluate("TP-STATE-DICT", spec, [obs])


def test_the_one_element_tie_on_one_module_is_that_finding():
    res = _tp(TP)
    assert res.verdict == "KNOWN" and {fid for _, fid in res.known} == {"fsdp2-set-model-state-dict-shared-module"}, res.describe()
    # one alias only: the Parameter is not held twice by one module
    single = dataclasses.replace(TP, ties=TP.ties[:1])
    assert _tp(single).verdict == "FAIL"
