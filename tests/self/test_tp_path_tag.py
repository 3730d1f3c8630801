"""TP-LAYOUT tags a case whose style FQN, with atoms left out, names another
module too (path:subsequence-resolves: the key "0.0" where the root has a
child "0"), so that tp-parallelize-module-fqn-applies-to-subsequence explains
the style's NotImplementedError from that other module on the releases that
have the bug, and only there (release matrix, 2.8.0 fake-w4 and gloo-w2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.tp.invariants import check_layout, style_path_subsequence_resolves
from conformance.areas.tp.observation import TpObservation
from conformance.areas.tp.oracle import predict_tp
from conformance.case.spec import CaseSpec
from conformance.run import known

pytestmark = pytest.mark.selfcheck

# ModelSeq(Sequential) > "0" ModuleList > "0" Linear; ColwiseParallel on "0.0"
CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "tp-style-path-subsequence.json").read_text())
ERROR = "NotImplementedError: ColwiseParallel currently only support nn.Linear and nn.Embedding!"
FINDING = next(k for k in known.load() if k.id == "tp-parallelize-module-fqn-applies-to-subsequence")


def _renamed(spec: CaseSpec) -> CaseSpec:
    """The same model with the ModuleList named "blocks": the key "blocks.0" has no other reading."""
    (child,) = spec.tree.children
    tree = dataclasses.replace(spec.tree, children=(dataclasses.replace(child, name="blocks"),))
    tp = dataclasses.replace(spec.tp, styles=(("blocks.0", "colwise"),))
    return dataclasses.replace(spec, tree=tree, tp=tp)


def _violations(spec: CaseSpec, error: str):
    obs = [TpObservation(api="fsdp2", rank=r, world_size=4, backend="fake", torch_version="2.8.0", wrap_error=error) for r in range(4)]
    return check_layout(spec, predict_tp(spec), obs)


def test_a_key_whose_atoms_name_another_module_is_tagged():
    assert style_path_subsequence_resolves(CASE)
    assert not style_path_subsequence_resolves(_renamed(CASE))


def test_the_finding_explains_the_style_error_only_where_torch_has_the_bug():
    (v,) = _violations(CASE, ERROR)
    assert "path:subsequence-resolves" in v.tags
    assert FINDING.matches(v, "2.8.0+cu128")
    assert not FINDING.matches(v, "2.13.0+cpu")
    (plain,) = _violations(_renamed(CASE), ERROR)
    assert not FINDING.matches(plain, "2.8.0+cu128")
    (other,) = _violations(CASE, "RuntimeError: something else went wrong")
    assert not FINDING.matches(other, "2.8.0+cu128")
