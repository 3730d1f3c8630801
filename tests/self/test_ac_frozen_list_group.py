"""fsdp2-frozen-list-group-freed-in-backward seen through activation
checkpointing (seed 62 of the ci profile, torch 2.13.0): a fully_shard([1,
0.0]) group whose module run last, the Embedding "1", is frozen and looked up
with constant indices; "0.0" ran before it, its forward under
torch.utils.checkpoint. FSDP2 leaves the group resharded for 0.0's backward,
which starts with the recompute: it runs on the sharded DTensor parameters
("aten.add.Tensor got mixed torch.Tensor and DTensor"). KNOWN as that
finding (the AC oracle tags the group), and only where its mechanism is:
with the Embedding trainable the same case trains."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.activation_checkpointing.oracle import predict_ac
from conformance.case.spec import CaseSpec
from conformance.run.runner import check_example

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]

CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "ac-frozen-list-group-recompute.json").read_text())
AC = ["AC-PARITY", "AC-STATE-DICT", "AC-ALLGATHER"]
FINDING = "fsdp2-frozen-list-group-freed-in-backward"


def _embedding_trainable(spec: CaseSpec) -> CaseSpec:
    def walk(m, path):
        params = tuple(dataclasses.replace(p, requires_grad=True) if path == "1" else p for p in m.params)
        return dataclasses.replace(m, params=params, children=tuple(walk(c, f"{path}.{c.name}" if path else c.name) for c in m.children))

    return dataclasses.replace(spec, tree=walk(spec.tree, ""))


def test_the_group_is_tagged_only_with_its_embedding_frozen():
    assert CASE.activation_checkpoint.kind == "utils-checkpoint" and CASE.plan.groups[1].modules == ("1", "0.0")
    assert "group:multi-frozen-embedding" in predict_ac(CASE).tags
    assert "group:multi-frozen-embedding" not in predict_ac(_embedding_trainable(CASE)).tags


def test_the_recompute_on_sharded_parameters_is_the_findings(fake_engine):
    results = check_example(AC, CASE, fake_engine)
    for r in results:
        assert r.verdict == "KNOWN", r.describe()
        assert {fid for _, fid in r.known} == {FINDING}, r.describe()
        assert all("mixed torch.Tensor and DTensor" in str(v) for v, _ in r.known), r.describe()
    # the Embedding trainable: the group is unsharded for the backward, the case trains
    for r in check_example(AC, _embedding_trainable(CASE), fake_engine):
        assert r.verdict in ("PASS", "UNCHECKED") and not r.known and not r.violations, r.describe()
