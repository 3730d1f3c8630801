"""Classes are identified by qualified name (module.QualName), never by a
bare __name__ two classes may share: PEFT's lora.Linear wraps torch's
nn.Linear under the same name. The graph, the strategies, the oracle, the
adapters and the repro script must all tell them apart (the suite bug this
guards against: KeyError 'Linear' in the rank on the LoRA Llama zoo model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.case.model_case import ModelCase
from conformance.case.spec import ModuleWrap, TransformerWrap, WrapPlan
from conformance.case.target import TargetError, base_graph, check_case
from conformance.run.runner import PASS, UNCHECKED, evaluate, observations

pytestmark = pytest.mark.selfcheck

TARGET = "tests.self.same_name_target:target"
OWN = "tests.self.same_name_target.Linear"
TORCH = "torch.nn.modules.linear.Linear"
ROOT = Path(__file__).resolve().parents[2]
OWN_UNITS = ["blocks.0.attn", "blocks.1.attn", ""]
TORCH_UNITS = ["blocks.0.attn.base_layer", "blocks.0.attn.lora_A", "blocks.0.attn.lora_B", "blocks.0.mlp",
               "blocks.1.attn.base_layer", "blocks.1.attn.lora_A", "blocks.1.attn.lora_B", "blocks.1.mlp", "head", ""]


def test_the_graph_holds_both_classes_by_qualified_name():
    g = base_graph(TARGET)
    assert {OWN, TORCH} <= set(g.class_ids())
    assert g.resolve_class(OWN) == OWN and g.resolve_class("Block") == "tests.self.same_name_target.Block"
    with pytest.raises(KeyError, match="ambiguous"):
        g.resolve_class("Linear")


def test_a_bare_shared_name_is_rejected_naming_both_classes():
    with pytest.raises(TargetError, match=r"'Linear'.*ambiguous.*same_name_target\.Linear.*torch\.nn\.modules\.linear\.Linear"):
        check_case(ModelCase(TARGET, plan=WrapPlan("fsdp1", ModuleWrap(("Linear",)))))


def test_strategies_draw_each_class_by_its_id():
    from conformance.strategies.targets import _model

    classes = _model(TARGET).classes
    assert classes[0] == OWN  # the target's wrap class first
    assert TORCH in classes and "Linear" not in classes


@pytest.mark.parametrize(("cls", "units"), [(OWN, OWN_UNITS), (TORCH, TORCH_UNITS)])
def test_the_oracle_wraps_only_the_named_class(cls, units):
    for pol in (ModuleWrap((cls,)), TransformerWrap((cls,))):
        assert [u.path for u in predict_fsdp1(ModelCase(TARGET, plan=WrapPlan("fsdp1", pol))).units] == units


@pytest.mark.fake
@pytest.mark.parametrize("cls", [OWN, TORCH])
@pytest.mark.parametrize("invariant", ["WRAP-UNITS", "WRAP-FQNS", "WRAP-STATE-DICT"])
def test_fsdp1_wraps_each_same_named_class_as_the_oracle_says(fake_engine, cls, invariant):
    from conformance.areas.autowrap.observation import WrapObservation

    case = ModelCase(TARGET, frozen=("blocks.0.attn.base_layer.weight",), plan=WrapPlan("fsdp1", ModuleWrap((cls,)), True))
    res = evaluate(invariant, case, observations(fake_engine, case, "fsdp1", WrapObservation.from_dict))
    assert res.verdict == PASS, res.describe()


@pytest.mark.fake
def test_drawn_cases_on_the_target_are_green():
    from conformance import check_model

    run = check_model(TARGET, invariants=["WRAP-UNITS", "WRAP-FQNS", "FROZEN-ERROR"], tiers=("fake",), examples=6, seed=0)
    assert run.checked and run.ok, run.summary() + "\n" + "\n".join(f["message"] for f in run.failures)


def test_the_repro_script_rebuilds_the_policy_by_qualified_name(tmp_path):
    from conformance.run.repro import repro_script

    bare = ModelCase(TARGET, plan=WrapPlan("fsdp1", ModuleWrap(("Block",))))  # a bare name unique in the model
    assert "POLICY = ('ModuleWrap', ('tests.self.same_name_target.Block',))" in repro_script(bare)
    own = ModelCase(TARGET, plan=WrapPlan("fsdp1", ModuleWrap((OWN,))))
    path = tmp_path / "repro.py"
    path.write_text(repro_script(own))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    units = [line.split("'")[1] for line in out.stdout.splitlines() if line.startswith("FSDP unit ")]
    assert sorted(units) == sorted(u or "<root>" for u in OWN_UNITS), out.stdout  # torch's Linear is no unit


# ---- torch's own classes by identity: size_based_auto_wrap_policy's force-leaf type ----


@pytest.mark.fake
@pytest.mark.parametrize("min_num_params", [1, 64, 300])
def test_size_policy_never_wraps_inside_multihead_attention(fake_engine, min_num_params):
    """force_leaf_modules (nn.MultiheadAttention by default): "their
    children will never be wrapped"; the oracle knows the type by identity."""
    from conformance.areas.autowrap.observation import WrapObservation
    from conformance.case.spec import SizeBasedWrap

    case = ModelCase("tests.self.mha_target:target", plan=WrapPlan("fsdp1", SizeBasedWrap(min_num_params)))
    units = [u.path for u in predict_fsdp1(case).units]
    assert not any(".attn" in u for u in units), units
    res = evaluate("WRAP-UNITS", case, observations(fake_engine, case, "fsdp1", WrapObservation.from_dict))
    assert res.verdict == PASS, res.describe()


@pytest.mark.fake
def test_a_unit_whose_forward_never_runs_is_outside_the_parity_promise(fake_engine):
    """MultiheadAttention reads out_proj.weight without calling out_proj: a
    policy that makes out_proj a unit (ModuleWrap(nn.Linear) matches its
    NonDynamicallyQuantizableLinear) leaves nothing to all-gather it. The
    graph knows which modules the model's forward never calls; training
    there is not promised (PARITY passes without comparing), as for a
    container unit; the structure invariants still run."""
    from conformance.areas.autowrap.observation import WrapObservation
    from conformance.areas.common.training_oracle import predict_training
    from conformance.areas.parity.observation import TrainObservation
    from conformance.case.spec import TrainPlan

    g = base_graph("tests.self.mha_target:target")
    assert g.not_called == {"blocks", "blocks.0.attn.out_proj", "blocks.1.attn.out_proj"}  # the ModuleList too
    case = ModelCase("tests.self.mha_target:target", plan=WrapPlan("fsdp1", ModuleWrap((TORCH,)), True), train=TrainPlan("SGD", 1))
    assert "forward never runs" in predict_training(case).applicable
    res = evaluate("PARITY", case, observations(fake_engine, case, "train", TrainObservation.from_dict))
    assert res.verdict == UNCHECKED and "forward never runs" in res.unchecked
    assert evaluate("WRAP-UNITS", case, observations(fake_engine, case, "fsdp1", WrapObservation.from_dict)).verdict == PASS
    from conformance.areas.common.fsdp2_oracle import predict_fsdp2
    from conformance.case.spec import ShardGroup

    fsdp2 = ModelCase("tests.self.mha_target:target", plan=WrapPlan("fsdp2", groups=(ShardGroup(("blocks.0.attn.out_proj",)),)))
    assert "never runs" in predict_fsdp2(fsdp2, "2.13.0").supported
