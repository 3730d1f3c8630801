"""The round trip's optimizer with two param groups (the matrices, and the
rest at another learning rate without weight decay): which one is empty is
tagged, and the two DCP findings about empty groups explain only their own
form, on the releases that have it (spec: set_optimizer_state_dict restores
the saved state, torch.optim.Optimizer.load_state_dict every group's
hyperparameters)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from conformance.areas.checkpoint.invariants import case_tags
from conformance.areas.checkpoint.oracle import predict_ckpt
from conformance.case.spec import CaseSpec, ModuleSpec, ParamSpec, SpecError, WrapPlan
from conformance.case.violation import Violation
from conformance.run import known

pytestmark = pytest.mark.selfcheck

CORPUS = Path(__file__).parents[2] / "conformance" / "run" / "corpus"
# a LayerNorm: no matrix, so the first group (the matrices) is empty
NORM = CaseSpec.from_json(json.dumps(json.loads((CORPUS / "dcp-empty-param-group-before-last-loses-hyperparameters.json").read_text())["spec"]))
LINEAR = ModuleSpec(name="0", cls="Linear", params=(ParamSpec("weight", (3, 2)), ParamSpec("bias", (3,))))


def _with(spec: CaseSpec, tree=None, groups: int = 2) -> CaseSpec:
    tree = tree or spec.tree
    return dataclasses.replace(spec, tree=tree, ckpt=dataclasses.replace(spec.ckpt, param_groups=groups))


def _violation(spec: CaseSpec, *kind: str) -> Violation:
    return Violation("CKPT-RESHARD", "param_groups differ from the saved", frozenset(case_tags(spec, predict_ckpt(spec)) | set(kind)))


def test_which_group_is_empty_is_tagged():
    matrices_only = dataclasses.replace(NORM.tree, children=(dataclasses.replace(LINEAR, params=LINEAR.params[:1]),))
    both = dataclasses.replace(NORM.tree, children=(LINEAR,))
    tags = {name: case_tags(s, predict_ckpt(s)) for name, s in
            (("norm", NORM), ("matrices", _with(NORM, matrices_only)), ("both", _with(NORM, both)), ("one group", _with(NORM, groups=1)))}
    assert {"param-groups:2", "param-groups:empty-not-last"} <= tags["norm"]
    assert {"param-groups:2", "param-groups:empty-last"} <= tags["matrices"]
    assert "param-groups:2" in tags["both"] and not any(t.startswith("param-groups:empty") for t in tags["both"])
    assert not any(t.startswith("param-groups") for t in tags["one group"])


@pytest.mark.parametrize("version,want", [("2.13.0", "dcp-empty-param-group-before-last-loses-hyperparameters"),
                                          ("2.6.0", "dcp-empty-param-group-before-last-loses-hyperparameters")])
def test_an_empty_group_before_the_last_is_its_finding(version, want):
    k = known.match(_violation(NORM, "kind:param-groups"), known.load(), version)
    assert k is not None and k.id == want
    # the groups differing with every group non-empty is another bug
    both = _with(NORM, dataclasses.replace(NORM.tree, children=(LINEAR,)))
    assert known.match(_violation(both, "kind:param-groups"), known.load(), version) is None


def test_an_empty_last_group_is_known_only_before_2_7():
    matrices_only = _with(NORM, dataclasses.replace(NORM.tree, children=(dataclasses.replace(LINEAR, params=LINEAR.params[:1]),)))
    v = _violation(matrices_only, "kind:param-groups")
    assert known.match(v, known.load(), "2.6.0").id == "dcp-empty-last-param-group-loses-hyperparameters"
    assert known.match(v, known.load(), "2.13.0") is None  # fixed in 2.7 (#147730): a FAIL there


def test_two_groups_need_per_parameter_optimizers_at_the_save_and_the_load():
    with pytest.raises(SpecError, match="param_groups=2"):
        dataclasses.replace(NORM, ckpt=dataclasses.replace(NORM.ckpt, load_plan=WrapPlan(api="fsdp1", use_orig_params=False)))
    with pytest.raises(SpecError, match="param_groups must be 1 or 2"):
        _with(NORM, groups=3)


# ---- a resume off single-process training from state FSDP1 saved for a parameter that had none ----

DATA = Path(__file__).parent / "data"


def test_a_resume_off_the_reference_only_for_the_stateless_parameter_is_that_finding():
    """ci seed 30144: FSDP1 (use_orig_params=True) saved on 3 ranks, a
    LayerNorm weight frozen in the one step and unfrozen after it; get_state_dict
    gave it Adam state (a step count) it never had, and the resume steps it as
    a second step. The resume difference of that parameter alone is
    fsdp1-optim-state-dict-trainable-param-without-state; of another parameter
    it is not."""
    from conformance.areas.checkpoint.invariants import check_optim
    from conformance.areas.checkpoint.observation import CkptObservation

    spec = CaseSpec.from_json((DATA / "ckpt-unfrozen-adam-resume.json").read_text())
    pred = predict_ckpt(spec)

    def obs(diff):
        return CkptObservation(kind="roundtrip", api="fsdp1", rank=0, world_size=2, backend="gloo", torch_version="2.13.0",
                               optim_ref=tuple(sorted(set(pred.trainable) - {"0.0.weight"})), resume_ref_diff=diff)

    for diff, want in ((("0.0.weight",), "fsdp1-optim-state-dict-trainable-param-without-state"), (("0.1.bias",), None)):
        vs = [v for v in check_optim(spec, pred, obs(diff)) if "kind:resume-reference" in v.tags]
        assert len(vs) == 1
        k = known.match(vs[0], known.load(), "2.13.0")
        assert (k.id if k else None) == want, vs[0].tags
