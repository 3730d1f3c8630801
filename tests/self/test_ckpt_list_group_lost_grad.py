"""fsdp2-list-group-reentered-loses-grad before a save (thorough seed
2902025126, torch 2.13.0, gloo and one rank): fully_shard([layers0.3.embed1,
layers0.0]) where layers0 is also registered as shared0, so the group runs
again after the frozen Embedding completed it. layers0.0's trainable
parameters end the save's training step with grad None and no optimizer
state; the load's get_state_dict initializes state for every trainable
parameter, and dcp.load raises "Missing key in checkpoint state_dict:
optim.state.layers0.0.weight.momentum_buffer". The finding explains that
missing key only where it names a parameter whose gradient the case loses
(key:lost-grad), not another parameter's, and not a case without the re-run
(`fsdp-conformance check`: the Embedding trainable, or no second name,
passes on 2 gloo ranks)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.checkpoint.invariants import check_optim, check_reshard
from conformance.areas.checkpoint.observation import CkptObservation
from conformance.areas.checkpoint.oracle import predict_ckpt
from conformance.case.spec import CaseSpec
from conformance.run import known

pytestmark = pytest.mark.selfcheck

CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "ckpt-list-group-rerun-lost-grad.json").read_text())
FINDING = "fsdp2-list-group-reentered-loses-grad"
TORCH = "2.13.0+cpu"


def _missing(fqn: str) -> CkptObservation:
    return CkptObservation(kind="roundtrip", api="fsdp2", rank=0, world_size=2, backend="gloo", torch_version=TORCH, phase="load",
                           error=f"CheckpointException: rank 0: RuntimeError: Missing key in checkpoint state_dict: optim.state.{fqn}.momentum_buffer.")


def _verdicts(spec: CaseSpec, obs: CkptObservation) -> dict[str, list[str | None]]:
    found = known.load()
    pred = predict_ckpt(spec)
    out = {}
    for inv, check in (("CKPT-RESHARD", check_reshard), ("OPTIM-STATE", check_optim)):
        vs = check(spec, pred, obs)
        assert isinstance(vs, list) and vs, (inv, vs)
        out[inv] = [getattr(known.match(v, found, TORCH), "id", None) for v in vs]
    return out


def _embedding_trainable(spec: CaseSpec) -> CaseSpec:
    def thaw(m):
        params = tuple(dataclasses.replace(p, requires_grad=True) for p in m.params)
        return dataclasses.replace(m, params=params, children=tuple(thaw(c) for c in m.children))

    return dataclasses.replace(spec, tree=thaw(spec.tree))


def test_the_missing_key_of_a_parameter_that_lost_its_gradient_is_known():
    assert _verdicts(CASE, _missing("layers0.0.weight")) == {"CKPT-RESHARD": [FINDING], "OPTIM-STATE": [FINDING]}
    # its other name (shared0) is the same parameter
    assert _verdicts(CASE, _missing("shared0.0.bias")) == {"CKPT-RESHARD": [FINDING], "OPTIM-STATE": [FINDING]}


def test_another_parameter_s_missing_key_is_not_this_finding():
    # layers0.3 is outside the group: its gradient is not lost
    assert _verdicts(CASE, _missing("layers0.3.weight")) == {"CKPT-RESHARD": [None], "OPTIM-STATE": [None]}


def test_without_the_frozen_embedding_or_the_second_name_nothing_is_lost():
    for spec in (_embedding_trainable(CASE), dataclasses.replace(CASE, shared=())):
        assert _verdicts(spec, _missing("layers0.0.weight")) == {"CKPT-RESHARD": [None], "OPTIM-STATE": [None]}


def test_state_lost_at_the_save_is_known_only_for_those_parameters():
    ref = ("layers0.0.bias", "layers0.0.weight", "layers0.3.weight")
    obs = CkptObservation(kind="roundtrip", api="fsdp2", rank=0, world_size=2, backend="gloo", torch_version=TORCH,
                          optim_ref=ref, optim_saved=("layers0.3.weight",), optim_loaded=("layers0.3.weight",))
    pred = predict_ckpt(CASE)
    found = known.load()
    got = {v.message.split()[0]: getattr(known.match(v, found, TORCH), "id", None)
           for v in check_optim(CASE, pred, obs) if "kind:lost-at-save" in v.tags}
    assert got == {"layers0.0.bias": FINDING, "layers0.0.weight": FINDING}
    lost_elsewhere = dataclasses.replace(obs, optim_saved=("layers0.0.bias", "layers0.0.weight"), optim_loaded=("layers0.0.bias", "layers0.0.weight"))
    assert [getattr(known.match(v, found, TORCH), "id", None) for v in check_optim(CASE, pred, lost_elsewhere)
            if "kind:lost-at-save" in v.tags] == [None]


def test_the_case_is_the_one_the_module_describes():
    block = CASE.tree.children[0].children[0]
    assert [p.name for p in block.params] == ["weight", "bias"] and all(p.requires_grad for p in block.params)
    assert [s.name for s in CASE.shared] == ["shared0"] and CASE.plan.groups[0].modules == ("layers0.3.embed1", "layers0.0")
