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


def test_a_module_styled_by_two_keys_is_the_finding_too():
    """The keys "proj0" and "model1.proj0": on 2.8 the longer one also
    styles "proj0", which is distributed twice (release matrix re-run, 2.8.0
    gloo-w2); another RuntimeError in the same case is not the finding."""
    (v,) = _violations(CASE, "RuntimeError: distribute_module should only be called once on a module, but it has already been called on this module!")
    assert "error:distributed-twice" in v.tags and FINDING.matches(v, "2.8.0+cu128") and not FINDING.matches(v, "2.9.1")
    (other,) = _violations(CASE, "RuntimeError: something else went wrong")
    assert "error:other" in other.tags and not FINDING.matches(other, "2.8.0+cu128")


# 2.9.1's words for stacking per-parameter norms from two meshes (release matrix re-run, gloo-w2; its repro says the same)
STACK_29 = ("RuntimeError: Sharding propagation failed for Op(op=aten.stack.default, args_schema=[DTensorSpec(mesh=DeviceMesh((dp=2), "
            "device: 'cpu', stride: (2,)), placements=(_NormPartial(reduce_op='sum', norm_type=2.0),)), DTensorSpec(mesh=DeviceMesh("
            "(dp=2, tp=2), device: 'cpu', stride: (2, 1)), placements=(_NormPartial(reduce_op='sum', norm_type=2.0),))] @ mesh: None)")


def test_the_mixed_mesh_refusal_is_tagged_in_each_release_s_words():
    from conformance.areas.tp.invariants import _error_tag

    assert _error_tag("RuntimeError: All operands in aten.stack.default must have the same mesh, but got DeviceMesh((dp=2, tp=2)) and DeviceMesh((dp=2))") == "error:mixed-meshes"
    assert _error_tag(STACK_29) == "error:mixed-meshes"
    one_mesh = STACK_29.replace("DeviceMesh((dp=2), ", "DeviceMesh((dp=2, tp=2), ")  # a propagation failure on one mesh is something else
    assert _error_tag(one_mesh) == "error:other"
