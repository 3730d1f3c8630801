"""fsdp2-frozen-list-group-freed-in-backward needs the frozen Embedding to
*complete* its list group's forward: FSDP2 registers a group's pre-backward
hook on the output of the module whose forward completes the group alone
(torch/distributed/fsdp/_fully_shard/_fsdp_state.py,
_register_group_forward_hooks), and a frozen Embedding's lookup needs no
gradient, so nothing unshards the group for its other modules' backward.
The corpus case (fully_shard(['2.embed1', '1']), the Embedding run last)
raises "setStorage ... storage of size 0"; the same model with the
Embedding run first trains (torch 2.13.0, fake and gloo). The oracle's
group:multi-frozen-embedding tag said only that a list group holds a frozen
Embedding, so a regression raising that error where the mechanism is absent
read KNOWN: it must be a FAIL."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conformance.areas.common.fsdp2_oracle import forward_calls, fsdp2_case_tags, predict_fsdp2
from conformance.case.spec import CaseSpec
from conformance.case.target import graph_of
from conformance.paths import PACKAGE
from conformance.run.runner import check_example

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]

CASE = CaseSpec.from_json(json.dumps(json.loads((PACKAGE / "run" / "corpus" / "fsdp2-frozen-list-group-freed-in-backward.json").read_text())["spec"]))
FINDING = "fsdp2-frozen-list-group-freed-in-backward"
TAG = "group:multi-frozen-embedding"


def _embedding_first(spec: CaseSpec) -> CaseSpec:
    """The root's children 0, 2 (the Block holding the frozen Embedding), 1:
    the frozen Linear '1', whose input needs a gradient, completes the group."""
    c = spec.tree.children
    assert [m.name for m in c] == ["0", "1", "2"]
    return dataclasses.replace(spec, tree=dataclasses.replace(spec.tree, children=(c[0], c[2], c[1])))


def _tags(spec: CaseSpec) -> set[str]:
    return fsdp2_case_tags(spec, predict_fsdp2(spec, torch.__version__))


def test_forward_calls_in_completion_order():
    g = graph_of(CASE)
    path = lambda nids: [g.module_path[n] for n in nids]  # noqa: E731
    assert path(forward_calls(CASE)) == ["", "0", "1", "2", "2.embed1"]
    assert path(forward_calls(CASE, completed=True)) == ["0", "1", "2.embed1", "2", ""]


def test_the_tag_needs_the_embedding_to_complete_the_group():
    assert CASE.plan.groups[0].modules == ("2.embed1", "1")
    assert TAG in _tags(CASE)
    assert TAG not in _tags(_embedding_first(CASE))


def test_the_embedding_run_first_trains_and_a_regression_there_is_a_failure(fake_engine, monkeypatch):
    known = check_example(["FSDP2-FROZEN"], CASE, fake_engine)[0]
    assert known.verdict == "KNOWN" and {fid for _, fid in known.known} == {FINDING}, known.describe()
    swapped = _embedding_first(CASE)
    clean = check_example(["FSDP2-FROZEN"], swapped, fake_engine)[0]
    assert clean.verdict == "PASS", clean.describe()
    # the fault: FSDP2 registers no pre-backward hook at all, so every group
    # stays resharded for its backward (the finding's error, its mechanism absent)
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    monkeypatch.setattr(FSDPState, "_register_pre_backward_hook", lambda self, output: output)
    broken = check_example(["FSDP2-FROZEN"], swapped, fake_engine)[0]
    assert broken.verdict == "FAIL" and not broken.known, broken.describe()
    assert any("storage of size 0" in str(v) for v in broken.violations), broken.describe()


FWD_CASE = CaseSpec.from_json((PACKAGE.parent / "tests" / "self" / "data" / "fwd-parity-frozen-list-group.json").read_text())


def _reshard_after_forward_false(spec: CaseSpec) -> CaseSpec:
    (group,) = spec.plan.groups
    return dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, groups=(dataclasses.replace(group, reshard_after_forward=False),)))


def test_fwd_parity_sees_the_same_backward_as_known_and_only_that_error(fake_engine):
    """Thorough seed 111 (torch 2.13.0, fake and gloo): fully_shard([2, 1]) on
    Sequential(Linear, Linear, Embedding), the frozen Linear 1 tied to the
    Embedding 2, which completes the group; the model's forward, then a
    registered method. FSDP2-FROZEN read the backward's raise KNOWN, FWD-PARITY
    FAIL: it had no rule. With reshard_after_forward=False it passes; the same
    tags with another error than the freed storage match nothing."""
    assert TAG in _tags(FWD_CASE)
    got = {r.invariant: r for r in check_example(["FWD-PARITY", "FSDP2-FROZEN"], FWD_CASE, fake_engine)}
    for inv in ("FWD-PARITY", "FSDP2-FROZEN"):
        r = got[inv]
        assert r.verdict == "KNOWN" and {fid for _, fid in r.known} == {FINDING}, r.describe()
        assert all("error:freed-storage" in v.tags for v, _ in r.known), r.describe()
    clean = check_example(["FWD-PARITY"], _reshard_after_forward_false(FWD_CASE), fake_engine)[0]
    assert clean.verdict in ("PASS", "UNCHECKED"), clean.describe()  # the fake tier compares no values
    from conformance.case.violation import Violation
    from conformance.run import known

    (v, _), = got["FWD-PARITY"].known
    other = Violation(v.invariant, "backward raised RuntimeError: something else", frozenset(v.tags - {"error:freed-storage"}))
    assert known.match(other, known.load(), torch.__version__) is None


RERUN_CASE = CaseSpec.from_json((PACKAGE.parent / "tests" / "self" / "data" / "fwd-parity-frozen-list-group-rerun.json").read_text())


def test_the_rerun_form_in_the_fully_shard_area_is_known_and_registered_once_it_passes(fake_engine):
    """Thorough seed 111 of the fully_shard area (torch 2.13.0, fake and gloo):
    fully_shard([proj1, embed2], reshard_after_forward=False) on a ModuleDict
    whose shared0 is proj1 again, so the group runs twice in one forward, the
    frozen Embedding tied to proj1.weight: the finding's rerun form, FAIL on
    FSDP2-FROZEN and FWD-PARITY before their rules. proj1 registered once, the
    same model trains."""
    assert "group:multi-frozen-embedding-rerun" in _tags(RERUN_CASE)
    for r in check_example(["FWD-PARITY", "FSDP2-FROZEN"], RERUN_CASE, fake_engine):
        assert r.verdict == "KNOWN" and {fid for _, fid in r.known} == {FINDING}, r.describe()
    once = dataclasses.replace(RERUN_CASE, shared=())
    assert "group:multi-frozen-embedding-rerun" not in _tags(once)
    for r in check_example(["FWD-PARITY", "FSDP2-FROZEN"], once, fake_engine):
        assert r.verdict in ("PASS", "UNCHECKED") and not r.violations, r.describe()


SECOND_PASS = CaseSpec.from_json((PACKAGE.parent / "tests" / "self" / "data" / "fsdp2-frozen-list-group-second-pass-completed-by-embedding.json").read_text())


def test_a_second_pass_completed_by_the_embedding_is_the_same_mechanism(fake_engine):
    """Seed 214 of the ci profile (torch 2.14.1; 2.13.0 alike): the group
    fully_shard(['3.embed0', '3.proj1']) is completed first by the Linear
    proj1, then runs again under the modules' second names (shared0 =
    proj1, shared1 = embed0) and that pass is completed by the frozen
    Embedding: the Linear's second call finds its weight freed in backward.
    The tag took only the first pass's completion, so the finding's own
    mechanism read FAIL; every pass counts now, and the case is KNOWN."""
    assert [g.modules for g in SECOND_PASS.plan.groups] == [("3.embed0", "3.proj1")]
    assert TAG in fsdp2_case_tags(SECOND_PASS, predict_fsdp2(SECOND_PASS, torch.__version__))
    (res,) = check_example(["FSDP2-FROZEN"], SECOND_PASS, fake_engine)
    assert res.verdict == "KNOWN" and {fid for _, fid in res.known} == {FINDING}, res.describe()
