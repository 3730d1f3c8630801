"""SD-FULL takes full state dicts of a model in use (a forward first) and
under mixed precision (FSDP1's MixedPrecision, FSDP2's
MixedPrecisionPolicy): parameters saved in full precision, FSDP1's buffers
(cast to buffer_dtype by the first forward and kept so) saved in full
precision at the values that cast left. A dtype is structure: checked on
every tier. The checkpoint area had drawn neither; its first ci seeds with
them (torch 2.13.0, gloo) found two FSDP1 deviations:
- fsdp1-mp-paramless-unit-buffers-saved-low-precision: a buffer whose unit
  manages no parameter, nor does any unit above it (the root's own buffer,
  every parameter in child units), is saved in buffer_dtype;
- fsdp1-mp-state-dict-before-forward-rounds-buffers: a state dict before
  the first forward runs lazy init, which casts the buffers down at once:
  the checkpoint holds them rounded, and they stay low precision.
Spec: MixedPrecision docstring (param_dtype: 'for model checkpointing, the
parameters are always saved in full precision'; buffer_dtype: cast 'in the
first forward pass and keeps them in that dtype thereafter. For model
checkpointing, the buffers are saved in full precision except for
LOCAL_STATE_DICT')."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, find, settings

from conformance.areas.checkpoint.observation import CkptObservation
from conformance.areas.checkpoint.oracle import predict_ckpt
from conformance.areas.checkpoint.repro import ckpt_script
from conformance.case.spec import (
    BufferSpec,
    CaseSpec,
    CheckpointPlan,
    ClassSpec,
    ModuleSpec,
    ModuleWrap,
    ParamSpec,
    Precision,
    SpecError,
    WrapPlan,
)
from conformance.run.runner import FAIL, KNOWN, PASS, evaluate
from conformance.strategies.checkpoint import checkpoint_specs

pytestmark = pytest.mark.selfcheck

PARAMLESS = "fsdp1-mp-paramless-unit-buffers-saved-low-precision"
EARLY = "fsdp1-mp-state-dict-before-forward-rounds-buffers"
BF16 = Precision(param_dtype="bfloat16", buffer_dtype="bfloat16")


def case(*, root_param: bool, wrap=("Block",), warm: bool = True, precision=BF16, api: str = "fsdp1") -> CaseSpec:
    """The root's buffer 'running'; Block (its own buffer, no parameter of
    its own) over proj0; FSDP1 with ``wrap``'s classes as units."""
    block = ModuleSpec("block", "Block", (), (BufferSpec("running", (3,)),), children=(
        ModuleSpec("proj0", "Linear", (ParamSpec("weight", (3, 3)),)),
    ))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),) if root_param else (), (BufferSpec("running", (3,)),), children=(block,))
    plan = WrapPlan(api="fsdp1", policy=ModuleWrap(wrap)) if api == "fsdp1" else WrapPlan(api="fsdp2")
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), plan=plan, seed=3,
                    ckpt=CheckpointPlan(full_sd="fsdp1-full" if api == "fsdp1" else "dcp-full", warm=warm, precision=precision))


def obs(spec: CaseSpec, rank: int, **kw) -> CkptObservation:
    return CkptObservation(kind="sd-full", api=spec.plan.api, rank=rank, world_size=2, backend="gloo",
                           torch_version=torch.__version__, keys=tuple(sorted(predict_ckpt(spec).sd_keys)), **kw)


def verdict(spec: CaseSpec, **kw):
    return evaluate("SD-FULL", spec, [obs(spec, 0, **kw), obs(spec, 1, **kw)])


def test_the_full_state_dict_cases_draw_a_forward_and_mixed_precision():
    quiet = settings(max_examples=3000, database=None, suppress_health_check=list(HealthCheck))
    for api in ("fsdp1", "fsdp2"):
        s = find(checkpoint_specs("full", api=api), lambda s: s.ckpt.warm and s.ckpt.precision is not None, settings=quiet)
        assert s.plan.api == api
    s = find(checkpoint_specs("full", api="fsdp1"), lambda s: s.ckpt.precision is not None and s.ckpt.precision.buffer_dtype is not None,
             settings=quiet)
    assert s.plan.api == "fsdp1"


def test_buffer_dtype_is_fsdp1s_and_precision_one_of_the_areas():
    with pytest.raises(SpecError, match="buffer_dtype is FSDP1's"):
        case(root_param=True, api="fsdp2")
    with pytest.raises(SpecError, match="CKPT_PRECISIONS"):
        case(root_param=True, precision=Precision(param_dtype="bfloat16", reduce_dtype="float32"))
    case(root_param=True, api="fsdp2", precision=Precision(param_dtype="bfloat16"))


def test_the_oracle_rounds_the_buffers_after_a_forward_only():
    warm, cold = case(root_param=True), case(root_param=True, warm=False)
    assert predict_ckpt(warm).buffer_dtype == "bfloat16"
    assert set(predict_ckpt(warm).rounded_buffers) == {"running", "block.running"}
    assert predict_ckpt(cold).rounded_buffers == ()
    assert predict_ckpt(case(root_param=True, precision=Precision(param_dtype="bfloat16"))).rounded_buffers == ()


def test_paramless_units_are_those_with_no_parameter_up_to_the_root():
    # the root without a parameter: its own buffer; Block's unit has none of
    # its own either, but proj0 is in Block's unit (no Linear unit): Block's
    # unit manages proj0.weight
    assert predict_ckpt(case(root_param=False)).buffers_in_paramless_units == ("running",)
    # with a Linear unit below Block, Block's unit manages nothing: its buffer too
    assert set(predict_ckpt(case(root_param=False, wrap=("Block", "Linear"))).buffers_in_paramless_units) == {"running", "block.running"}
    # a root with a parameter casts back every buffer below it
    assert predict_ckpt(case(root_param=True, wrap=("Block", "Linear"))).buffers_in_paramless_units == ()


def test_a_buffer_of_a_paramless_unit_saved_low_precision_is_known():
    spec = case(root_param=False)
    assert verdict(spec).verdict == PASS
    res = verdict(spec, wrong_dtypes=(("running", "bfloat16"),))
    assert res.verdict == KNOWN and {fid for _, fid in res.known} == {PARAMLESS}, res.describe()
    assert all("dtype-keys:paramless-units" in v.tags for v, _ in res.known)


@pytest.mark.parametrize("spec,wrong", [
    (case(root_param=True), (("running", "bfloat16"),)),  # the root has a parameter: its hook casts back
    (case(root_param=False), (("running", "bfloat16"), ("block.proj0.weight", "bfloat16"))),  # a parameter in bf16: another bug
    (case(root_param=False), (("running", "float64"),)),  # not buffer_dtype: another bug
], ids=["root-with-param", "a-parameter", "another-dtype"])
def test_a_buffer_saved_low_precision_elsewhere_fails(spec, wrong):
    res = verdict(spec, wrong_dtypes=wrong)
    assert res.verdict == FAIL and not res.known, res.describe()
    assert any("kind:dtype" in v.tags for v in res.violations)


def test_buffers_rounded_before_the_first_forward_are_known():
    cold = case(root_param=True, warm=False)
    res = verdict(cold, wrong_values=("running",), rounded=("running",))
    assert res.verdict == KNOWN and {fid for _, fid in res.known} == {EARLY}, res.describe()
    # after a forward the rounding is promised: a rounded value there is
    # the oracle's; any other wrong value is not this finding
    res = verdict(case(root_param=True), wrong_values=("running",), rounded=())
    assert res.verdict == FAIL and not res.known, res.describe()
    res = verdict(cold, wrong_values=("running",), rounded=())
    assert res.verdict == FAIL and not res.known, res.describe()
    res = verdict(cold, wrong_values=("running", "block.proj0.weight"), rounded=("running",))
    assert res.verdict == FAIL and not res.known, res.describe()


def test_the_repro_wraps_with_the_precision_and_runs_the_forward():
    for api, precision, text in (("fsdp1", BF16, "mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)"),
                                 ("fsdp2", Precision(param_dtype="bfloat16"), "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)")):
        script = ckpt_script(case(root_param=True, api=api, precision=precision), title="SD-FULL")
        assert text in script
        assert "LOAD_PATH, WARM = 'load_state_dict', True" in script  # the forward before the state dict
        assert f"BUFFER_DTYPE = {precision.buffer_dtype!r}" in script
    no_mp = ckpt_script(dataclasses.replace(case(root_param=True), ckpt=CheckpointPlan(full_sd="fsdp1-full")), title="SD-FULL")
    assert "mixed_precision=" not in no_mp and "import MixedPrecision" not in no_mp and ", MixedPrecision" not in no_mp


# ---- a forward first reaches fsdp2-tied-list-group-unsharded-save-segfault ----------

def tied_list_group(order: tuple[str, str]) -> CaseSpec:
    """Thorough seed 1984394500 (torch 2.13.0, gloo): fully_shard([proj1,
    proj0], reshard_after_forward=False), proj0.weight tied to proj1.weight,
    a bf16 forward, then the full state dict: reading proj0.weight's value
    raised 'data is not allocated yet', or the rank died (signal 11)."""
    from conformance.case.spec import ShardGroup, TiedParam

    kids = tuple(ModuleSpec(n, "Linear", (ParamSpec("weight", (1, 1)),)) for n in ("proj0", "proj1"))
    return CaseSpec(tree=ModuleSpec("", "Model", children=kids), classes=(ClassSpec("Model"),),
                    ties=(TiedParam("proj0", "weight", "proj1.weight"),),
                    plan=WrapPlan(api="fsdp2", groups=(ShardGroup(order, reshard_after_forward=False),)),
                    ckpt=CheckpointPlan(warm=True, precision=Precision(param_dtype="bfloat16")))


def _known(spec: CaseSpec, *extra: str):
    from conformance.areas.checkpoint.invariants import case_tags
    from conformance.case.violation import Violation
    from conformance.run import known

    tags = frozenset(case_tags(spec, predict_ckpt(spec)) | {"backend:gloo", *extra})
    got = known.match(Violation("SD-FULL", "[SD-FULL] rank 0: ...", tags), known.load(), "2.13.0")
    return got.id if got is not None else None


def test_a_freed_value_read_after_a_forward_is_the_tied_list_group_finding():
    read = ("kind:raised", "phase:read", "error:RuntimeError", "cause:data-not-allocated")
    reversed_, in_order = tied_list_group(("proj1", "proj0")), tied_list_group(("proj0", "proj1"))
    for form in (read, ("kind:crash",)):
        assert _known(reversed_, *form) == "fsdp2-tied-list-group-unsharded-save-segfault", form
        assert _known(in_order, *form) is None, form  # listed in registration order: the hook is reached first
        cold = dataclasses.replace(reversed_, ckpt=dataclasses.replace(reversed_.ckpt, warm=False))
        assert _known(cold, *form) is None, form  # no forward: the group is sharded at the save
