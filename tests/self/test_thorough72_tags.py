"""Thorough seed 72 (torch 2.13.0, gloo): CKPT-RESHARD and OPTIM-STATE
FAILed on fully_shard([3, 2]) with 2.weight tied to the Embedding 3's,
trainable at the save and frozen at the load: the training after the save,
under the mask at load (the save side's continued run), raised "setStorage
... storage of size 0". The Embedding, run last, completes the group:
fsdp2-frozen-list-group-freed-in-backward's mechanism under the load's mask
(the checkpoint area tagged the save's mask only; with the Embedding
trainable at load the run goes on). The same error with the Embedding
trainable at load matches nothing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.checkpoint.observation import CkptObservation
from conformance.case.model_case import case_from_json
from conformance.run.runner import evaluate

pytestmark = pytest.mark.selfcheck

CKPT = case_from_json((Path(__file__).parent / "data" / "ckpt-embedding-frozen-at-load-list-group.json").read_text())
FREED = ("RuntimeError: setStorage: sizes [1, 1], strides [1, 1], storage offset 0, and itemsize 4 requiring a storage size "
         "of 4 are out of bounds for storage of size 0")


def _resume(spec, invariant):
    obs = [CkptObservation(kind="roundtrip", api="fsdp2", rank=r, world_size=2, backend="gloo", torch_version="2.13.0",
                           error=FREED, phase="resume") for r in range(2)]
    return evaluate(invariant, spec, obs)


@pytest.mark.parametrize("invariant", ["CKPT-RESHARD", "OPTIM-STATE"])
def test_the_training_after_the_save_under_the_load_mask_is_that_finding(invariant):
    assert CKPT.plan.groups[0].modules == ("3", "2") and CKPT.ckpt.load_frozen == ("3.weight",)
    res = _resume(CKPT, invariant)
    assert res.verdict == "KNOWN" and {fid for _, fid in res.known} == {"fsdp2-frozen-list-group-freed-in-backward"}, res.describe()
    trainable = dataclasses.replace(CKPT, ckpt=dataclasses.replace(CKPT.ckpt, load_frozen=()))
    other = _resume(trainable, invariant)
    assert other.verdict == "FAIL", other.describe()
