"""The AC adapter's guard names a parameter read as FSDP1's sharded view
(use_orig_params=True puts the rank's 1-D shard back in the parameter when a
unit reshards), with a message that is the same on every rank, and
fsdp1-reentrant-checkpoint-frees-unit-early explains it: a root unit with two
reentrant regions reshards in the first region's backward, and the other
region's recompute reads the shard (seed 35 of the ci profile, torch 2.13.0,
reported shape errors that differed by rank: "size mismatch, got input (2),
mat (2x7), vec (39)", "'weight' must be 2-D", "weight of shape [0]")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conformance.areas.activation_checkpointing.adapter import guard_freed_reads
from conformance.areas.activation_checkpointing.invariants import error_tag
from conformance.areas.activation_checkpointing.observation import ACObservation
from conformance.case.build import build
from conformance.case.spec import CaseSpec
from conformance.run.runner import FAIL, KNOWN, evaluate

pytestmark = pytest.mark.selfcheck

CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "ac-fsdp1-two-reentrant-regions-uop.json").read_text())
FINDING = "fsdp1-reentrant-checkpoint-frees-unit-early"


def test_the_guard_names_a_sharded_view_alike_on_every_rank():
    messages = []
    for shard in (torch.zeros(25), torch.zeros(0)):  # two ranks' shards of a 7x7 weight
        built = build(CASE)
        guard_freed_reads(built)
        proj = built.modules["0.proj1"]
        proj.weight.data = shard  # what FSDP1 use_orig_params=True does when it reshards
        with pytest.raises(RuntimeError) as e:
            proj(torch.zeros(2, 7))
        messages.append(str(e.value))
    assert messages[0] == messages[1] == "0.proj1.weight read in forward as FSDP's sharded view, not its [7, 7] parameter"
    assert error_tag(messages[0]) == "error:resharded-view"
    built = build(CASE)
    guard_freed_reads(built)
    built.modules["0.proj1"](torch.zeros(2, 7))  # its own shape: no complaint
    assert isinstance(built.modules["0.proj1"].weight, nn.Parameter)


def _raised(text: str, spec: CaseSpec = CASE):
    obs = [ACObservation(api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0", step_error=f"RuntimeError: {text}")
           for r in range(2)]
    return evaluate("AC-PARITY", spec, obs)


def test_the_finding_explains_the_read_under_use_orig_params_only():
    res = _raised("0.proj1.weight read in forward as FSDP's sharded view, not its [7, 7] parameter")
    assert res.verdict == KNOWN and {fid for _, fid in res.known} == {FINDING}, res.describe()
    assert _raised("size mismatch, got input (2), mat (2x7), vec (39)").verdict == FAIL  # an unnamed shape error stays a failure


# FSDP1 use_orig_params=True, SizeBasedWrap(1): the checkpoint_wrapper around
# the ModuleDict 0.0 becomes a unit holding 0.0.bias, which 0.1 reads as its
# tied bias after that unit resharded (fsdp1-tie-below-lca-not-rejected). The
# one-element bias lies whole in rank 1's shard of a world of 2: the view has
# the bias's own shape there and the wrong shape on rank 0 (ci, seed 81).
TIED_BIAS = CaseSpec.from_json((Path(__file__).parent / "data" / "ac-fsdp1-tied-bias-whole-in-one-shard.json").read_text())
TIE_FINDING = "fsdp1-tie-below-lca-not-rejected"


def test_a_tied_read_of_a_sharded_unit_raises_on_every_rank_alike():
    """Before: rank 0 raised, rank 1 read its shard (shaped right by chance)
    and went on into backward's all-gather, and the ranks hung until the
    pool's deadline (60 s: HANG, no finding). The guard now asks the
    parameter's FSDP handle whether it is sharded: the same answer on every
    rank."""
    from conformance.engine.fake import FakeEngine

    errors = []
    for rank in range(2):
        engine = FakeEngine(world_size=2, rank=rank)
        try:
            (rec,) = engine.run("activation-checkpointing", TIED_BIAS)
        finally:
            engine.close()
        assert rec["ok"], rec
        errors.append(rec["value"]["step_error"])
    assert errors[0] == errors[1] == "RuntimeError: 0.1.bias read in forward as FSDP's sharded view, not its [1] parameter"


# the size policy's unit around checkpoint_wrapper(0) holds 0.weight, which 1
# reads as its tied weight (ci, seed 81: FAIL on both tiers before the rule)
BELOW_TIE = CaseSpec.from_json((Path(__file__).parent / "data" / "ac-fsdp1-wrapper-unit-below-tie.json").read_text())


def test_the_tie_finding_explains_a_read_of_the_tie_outside_its_unit_only():
    res = _raised("1.weight read in forward as FSDP's sharded view, not its [1, 1] parameter", BELOW_TIE)
    assert res.verdict == KNOWN and {fid for _, fid in res.known} == {TIE_FINDING}, res.describe()
    # the same read of the unit's own name: not the tie's outside user
    assert _raised("0.weight read in forward as FSDP's sharded view, not its [1, 1] parameter", BELOW_TIE).verdict == FAIL
    res = _raised("0.1.bias read in forward as FSDP's sharded view, not its [1] parameter", TIED_BIAS)
    assert res.verdict == KNOWN and {fid for _, fid in res.known} == {TIE_FINDING}, res.describe()
