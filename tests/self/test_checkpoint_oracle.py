"""The checkpoint oracle and case tags on hand-written cases: which
parameters carry no optimizer state at the save, the tags known failures
match on (a tie inside one module, a parameter unfrozen at the load), and the
load side's mask (without load_frozen: the mask at the save)."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.areas.checkpoint.invariants import case_tags
from conformance.areas.checkpoint.oracle import predict_ckpt
from conformance.case.spec import CaseSpec, CheckpointPlan, ClassSpec, ModuleSpec, ParamSpec, TiedParam, WrapPlan

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]


def linear(ckpt: CheckpointPlan, *, weight_frozen: bool = True) -> CaseSpec:
    tree = ModuleSpec("", "Model", children=(
        ModuleSpec("proj0", "Linear", (ParamSpec("weight", (4, 4), not weight_frozen), ParamSpec("bias", (4,)))),
    ))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"),), plan=WrapPlan(api="fsdp2"), ckpt=ckpt)


@pytest.mark.parametrize("ckpt,untrained,unfrozen", [
    # frozen throughout, frozen at load: no state, nothing asks for one
    (CheckpointPlan(), ["proj0.weight"], False),
    # frozen throughout, trainable at load: the resume asks for state never saved
    (CheckpointPlan(load_frozen=()), ["proj0.weight"], True),
    # unfrozen after the first of two steps: it trained, it has state
    (CheckpointPlan(steps=2, refreeze=("proj0.weight",)), [], False),
    # unfrozen after the first of one step: it never trained before the save
    (CheckpointPlan(steps=1, refreeze=("proj0.weight",)), ["proj0.weight"], True),
], ids=["frozen-both", "unfrozen-at-load", "unfrozen-before-save", "unfrozen-after-last-step"])
def test_untrained_at_save_and_the_unfrozen_at_load_tag(ckpt, untrained, unfrozen):
    spec = linear(ckpt)
    pred = predict_ckpt(spec)
    assert list(pred.untrained_at_save) == untrained
    assert ("unfrozen-at-load" in case_tags(spec, pred)) is unfrozen


def test_trained_then_frozen_has_state_and_no_unfrozen_tag():
    spec = linear(CheckpointPlan(steps=2, refreeze=("proj0.bias",), load_frozen=()), weight_frozen=False)
    pred = predict_ckpt(spec)
    assert pred.untrained_at_save == ()
    assert "unfrozen-at-load" not in case_tags(spec, pred)


def _tied(module: str, source: str) -> CaseSpec:
    tree = ModuleSpec("", "Model", children=(
        ModuleSpec("a", "LayerNorm", (ParamSpec("weight", (3,)), ParamSpec("bias", (3,)))),
        ModuleSpec("b", "LayerNorm", (ParamSpec("weight", (3,)), ParamSpec("bias", (3,)))),
    ))
    name, src = module.rsplit(".", 1), source
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"),), ties=(TiedParam(name[0], name[1], src),),
                    plan=WrapPlan(api="fsdp2"), ckpt=CheckpointPlan(load_path="set_model_state_dict"))


@pytest.mark.parametrize("tied_name,source,same", [
    ("a.weight", "a.bias", True),  # one module, two names
    ("b.weight", "a.weight", False),  # two modules
], ids=["in-one-module", "across-modules"])
def test_tie_in_one_module_tag(tied_name, source, same):
    spec = _tied(tied_name, source)
    assert ("tie:same-module" in case_tags(spec, predict_ckpt(spec))) is same


def test_the_load_side_keeps_the_mask_of_the_save_without_load_frozen():
    from conformance.areas.checkpoint.adapter import load_spec
    from conformance.case.graph import ModelGraph

    def frozen(spec: CaseSpec) -> set[str]:
        g = ModelGraph(spec)
        return {f for f, pid in g.named_parameters() if not g.requires_grad(pid)}

    spec = linear(CheckpointPlan(steps=2, refreeze=("proj0.weight", "proj0.bias")))
    pred = predict_ckpt(spec)
    assert frozen(load_spec(spec)) == set(pred.frozen_at_load) == {"proj0.bias"}
    spec = linear(CheckpointPlan(load_frozen=("proj0.bias",)))
    assert frozen(load_spec(spec)) == {"proj0.bias"}


@pytest.mark.parametrize("shapes,world,empty", [
    ([(1, 1)], 2, True),  # dim 0 of 1 on 2 ranks
    ([(2,), (2,), (2,)], 3, True),  # the flat parameter splits evenly, each parameter's chunks do not
    ([(2,), (2,)], 2, False),
    ([(3,)], 2, False),  # uneven, not empty
    ([(1,)], 1, False),
], ids=["dim0-1-on-2", "three-2s-on-3", "two-2s-on-2", "3-on-2", "world-1"])
def test_fsdp1_param_empty_chunk_tag(shapes, world, empty):
    tree = ModuleSpec("", "Model", params=tuple(ParamSpec(f"p{i}", s) for i, s in enumerate(shapes)))
    spec = CaseSpec(tree=tree, classes=(ClassSpec("Model"),), plan=WrapPlan(api="fsdp1"),
                    ckpt=CheckpointPlan(save_world=world, load_world=1, load_plan=WrapPlan(api="fsdp2")))
    tags = case_tags(spec, predict_ckpt(spec))
    assert ("shard:param-empty-save" in tags) is empty
    assert "shard:param-empty-load" not in tags  # FSDP2 at the load


def _both_frozen(ckpt: CheckpointPlan) -> CaseSpec:
    spec = linear(ckpt)
    lin = spec.tree.children[0]
    lin = dataclasses.replace(lin, params=tuple(dataclasses.replace(p, requires_grad=False) for p in lin.params))
    return dataclasses.replace(spec, tree=dataclasses.replace(spec.tree, children=(lin,)))


@pytest.mark.parametrize("spec,empty", [
    # nothing trains in the only step; the weight is unfrozen before the save
    (_both_frozen(CheckpointPlan(steps=1, refreeze=("proj0.weight",))), True),
    (_both_frozen(CheckpointPlan(steps=1)), False),  # nothing trainable at the save either
    (_both_frozen(CheckpointPlan(steps=2, refreeze=("proj0.weight",))), False),  # the weight trains in step 2
    (linear(CheckpointPlan(steps=1)), False),  # the bias trained
    (linear(CheckpointPlan(steps=1, refreeze=("proj0.bias",))), False),  # the bias trained, then frozen
], ids=["nothing-trained-weight-unfrozen", "nothing-trainable", "trained-in-step-2", "bias-trained", "bias-trained-then-frozen"])
def test_optim_empty_at_save_tag(spec, empty):
    assert ("optim-empty-at-save" in case_tags(spec, predict_ckpt(spec))) is empty


@pytest.mark.parametrize("spec,tagged", [
    (_both_frozen(CheckpointPlan(steps=2, refreeze=("proj0.weight",))), True),  # nothing trains in step 0, then the weight does
    (_both_frozen(CheckpointPlan(steps=2)), False),  # nothing is ever unfrozen
    (linear(CheckpointPlan(steps=2, refreeze=("proj0.weight",))), False),  # the bias trains in step 0
], ids=["unfrozen-after-a-frozen-step", "never-unfrozen", "bias-trains-first"])
def test_nothing_trains_first_tag(spec, tagged):
    assert ("nothing-trains-first" in case_tags(spec, predict_ckpt(spec))) is tagged


def test_no_shard_unit_tag():
    from conformance.case.spec import CustomWrap

    spec = linear(CheckpointPlan(full_sd="fsdp1-full", rank0_only=True))
    no_shard = CustomWrap(targets=("proj0",), kwargs=(("proj0", (("sharding_strategy", "NO_SHARD"),)),))
    for policy, tagged in ((no_shard, True), (CustomWrap(targets=("proj0",)), False)):
        case = dataclasses.replace(spec, plan=WrapPlan(api="fsdp1", policy=policy))
        assert ("no-shard-unit" in case_tags(case, predict_ckpt(case))) is tagged


def test_resume_comparison_takes_nan_where_the_reference_has_nan():
    import math

    from conformance.areas.checkpoint.adapter import _close

    nan = math.nan
    assert _close([nan, 1.0], [nan, 1.0])  # both diverged: the same training
    assert not _close([nan, 1.0], [0.5, 1.0])  # NaN where the reference has a value
    assert not _close([1.0, 1.0], [1.1, 1.0])


def _checkpoint_exception(failures: dict[int, BaseException]):
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("CheckpointException", {r: (e, traceback.StackSummary()) for r, e in failures.items()})


def test_a_checkpoint_exception_reports_the_first_failing_ranks_inner_exception():
    """A CheckpointException's first line names only the ranks; the observation
    carries the first failing rank's exception (type, first line), and the
    violation keeps error:CheckpointException with cause: tags beside it."""
    from conformance.areas.checkpoint.adapter import _err
    from conformance.areas.checkpoint.invariants import _raised
    from conformance.areas.checkpoint.observation import CkptObservation

    e = _checkpoint_exception({1: ValueError("Size mismatch between saved torch.Size([7, 7]) and current: torch.Size([25]) for model.w"),
                               0: RuntimeError("Missing key in checkpoint state_dict: optim.state.a.momentum_buffer.\nsecond line")})
    assert str(e).splitlines()[0].startswith("CheckpointException ranks:")
    text = _err(e)
    assert text == "CheckpointException: rank 0: RuntimeError: Missing key in checkpoint state_dict: optim.state.a.momentum_buffer."
    obs = CkptObservation(kind="roundtrip", api="fsdp2", rank=0, world_size=2, backend="gloo", torch_version="x", error=text, phase="load")
    [v] = _raised("CKPT-RESHARD", obs, set())
    assert {"error:CheckpointException", "cause:RuntimeError", "cause:missing-key", "phase:load"} <= v.tags
    assert "momentum_buffer" in v.message
    size = _err(_checkpoint_exception({1: ValueError("Size mismatch between saved torch.Size([7, 7]) and current: torch.Size([25])")}))
    assert size.startswith("CheckpointException: rank 1: ValueError: Size mismatch")
    [v] = _raised("CKPT-RESHARD", dataclasses.replace(obs, error=size), set())
    assert {"error:CheckpointException", "cause:ValueError", "cause:size-mismatch"} <= v.tags and "cause:missing-key" not in v.tags
    # any other exception: its type and first line, no cause tags
    assert _err(KeyError("x")) == "KeyError: 'x'"
    [v] = _raised("CKPT-RESHARD", dataclasses.replace(obs, error="RuntimeError: boom"), set())
    assert not any(t.startswith("cause:") for t in v.tags)


@pytest.mark.parametrize("message,tags", [
    # a name of a shared Parameter that is not its first: key:alias
    ("Missing key in checkpoint state_dict: optim.state.block1.tied0.momentum_buffer.", {"key:optim-state", "key:alias"}),
    ("Missing key in checkpoint state_dict: optim.state.proj0.weight.exp_avg.", {"key:optim-state"}),
    ("Missing key in checkpoint state_dict: optim.param_groups.", {"key:param-groups"}),
    ("Size mismatch between saved torch.Size([2, 2]) and current: torch.Size([3]) for model.block1.shared0.weight", {"key:model", "key:alias"}),
    ("Size mismatch between saved torch.Size([2, 2]) and current: torch.Size([3]) for model.proj0.weight", {"key:model"}),
])
def test_the_key_a_checkpoint_exception_names(message, tags):
    from conformance.areas.checkpoint.invariants import cause_tags

    aliases = {"block1.tied0", "block1.shared0.weight"}  # proj0.weight is the first name
    got = set(cause_tags(f"CheckpointException: rank 0: RuntimeError: {message}", aliases))
    assert {t for t in got if t.startswith("key:")} == tags


@pytest.mark.parametrize("error,tags", [
    # FSDP1's optimizer state dict misses a unit's parameter under its name in the unit
    ("RuntimeError: block1.shared0.weight is not in the optimizer state. The FSDPParamInfo has the param keys "
     "['block1.shared0.weight', 'block1.weight'] while the optimizer has the param keys ['block1.weight'].",
     {"cause:not-in-optim-state", "key:alias"}),
    ("RuntimeError: proj0.weight is not in the optimizer state. The FSDPParamInfo has ...", {"cause:not-in-optim-state"}),
    ("AssertionError: block1.shared0.weight is not in the optimizer state.", set()),
    ("RuntimeError: the parameter is not in the optimizer state", set()),
])
def test_fsdp1_optim_state_conversion_error_tags(error, tags):
    from conformance.areas.checkpoint.invariants import cause_tags

    assert set(cause_tags(error, {"block1.tied0", "block1.shared0.weight"})) == tags


@pytest.mark.parametrize("error,tags", [
    # an unsharded parameter FSDP2 freed, read in backward (fsdp2-frozen-list-group-freed-in-backward, two ops' words)
    ("RuntimeError: setStorage: sizes [9], strides [1], storage offset 0, and itemsize 4 requiring a storage size of 36 are "
     "out of bounds for storage of size 0", {"cause:freed-storage"}),
    ("RuntimeError: The tensor has a non-zero number of elements, but its data is not allocated yet.", {"cause:data-not-allocated"}),
    ("RuntimeError: The tensor has a non-zero number of elements", set()),
])
def test_a_freed_parameter_read_in_backward(error, tags):
    from conformance.areas.checkpoint.invariants import cause_tags

    assert set(cause_tags(error)) == tags


@pytest.mark.parametrize("error,tags", [
    # FSDP1 (use_orig_params=False) rekeying the param_groups of an FSDP2
    # checkpoint: the shared Parameter's first name is unknown to it
    ("KeyError: 'proj0.weight'", {"key:first-of-shared"}),
    ("KeyError: 'block1.shared0.weight'", set()),  # a second name: not this form
    ("KeyError: 'proj1.weight'", set()),  # a name of a Parameter that has one
    ("KeyError: proj0.weight", {"key:first-of-shared"}),
])
def test_a_key_error_on_the_first_name_of_a_shared_parameter(error, tags):
    from conformance.areas.checkpoint.invariants import cause_tags

    assert set(cause_tags(error, {"block1.shared0.weight"}, {"proj0.weight"})) == tags


@pytest.mark.parametrize("loaded,saved,renamed", [
    (("block1.shared0.weight",), ("proj0.weight",), True),  # the same Parameter under its unit's name
    (("block1.shared0.weight",), ("other.weight",), False),
    ((), ("proj0.weight",), False),  # a parameter gone from the groups
])
def test_param_groups_renamed_alias_tag(loaded, saved, renamed):
    from conformance.areas.checkpoint.invariants import check_reshard
    from conformance.areas.checkpoint.observation import CkptObservation
    from conformance.case.spec import SharedModule

    tree = ModuleSpec("", "Model", children=(ModuleSpec("proj0", "Linear", (ParamSpec("weight", (2, 2)),)), ModuleSpec("block1", "Block")))
    spec = CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), shared=(SharedModule("block1", "shared0", "proj0"),),
                    plan=WrapPlan(api="fsdp2"), ckpt=CheckpointPlan(load_plan=WrapPlan(api="fsdp1")))
    obs = CkptObservation(kind="roundtrip", api="fsdp1", rank=0, world_size=2, backend="gloo", torch_version="x",
                          groups_diff=("group 0: params",), groups_params=((0, loaded, saved),))
    [v] = check_reshard(spec, predict_ckpt(spec), obs)
    assert "kind:param-groups" in v.tags and ("params:renamed-alias" in v.tags) == renamed
    assert str(list(saved)) in v.message


def _two_linears(ckpt: CheckpointPlan) -> CaseSpec:
    tree = ModuleSpec("", "Model", children=(
        ModuleSpec("proj0", "Linear", (ParamSpec("weight", (4, 4)),)),
        ModuleSpec("proj1", "Linear", (ParamSpec("weight", (4, 4)),)),
    ))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"),), plan=WrapPlan(api="fsdp2"), ckpt=ckpt)


@pytest.mark.parametrize("ckpt,uneven", [
    # proj0 frozen after the first of two steps: steps 1 and 2 in one flat parameter
    (CheckpointPlan(steps=2, refreeze=("proj0.weight",), load_frozen=(), load_plan=WrapPlan(api="fsdp1")), True),
    # use_orig_params=True: each parameter keeps its own step
    (CheckpointPlan(steps=2, refreeze=("proj0.weight",), load_frozen=(), load_plan=WrapPlan(api="fsdp1", use_orig_params=True)), False),
    # one step: proj0 trained it too (1 and 1)
    (CheckpointPlan(steps=1, refreeze=("proj0.weight",), load_frozen=(), load_plan=WrapPlan(api="fsdp1")), False),
    # every parameter trained every step
    (CheckpointPlan(steps=3, load_plan=WrapPlan(api="fsdp1")), False),
    # loaded under FSDP2: per-parameter state
    (CheckpointPlan(steps=2, refreeze=("proj0.weight",), load_frozen=()), False),
], ids=["flat-uneven", "orig-params", "one-step", "even", "fsdp2-load"])
def test_uneven_steps_in_a_load_unit(ckpt, uneven):
    spec = _two_linears(ckpt)
    pred = predict_ckpt(spec)
    assert pred.uneven_steps_in_load_unit is uneven
    assert ("load-unit:uneven-steps" in case_tags(spec, pred)) is uneven


@pytest.mark.parametrize("uop", [False, True], ids=["flat-uneven", "orig-params"])
def test_ranks_ending_with_different_merged_steps_is_the_merge_finding(uop):
    """Thorough seed 191916010 (2.13.0, gloo, 3 ranks): the merged step is
    the last write into one shared tensor, and the ranks did not end with
    the same one (rank 0's weight.step, rank 2's proj0.weight.step differed
    from the saved). The RANKS-AGREE violation carries the case's tags (the
    area's ranks_tags), so fsdp1-flat-param-optim-load-merges-step explains
    it where a load unit holds uneven steps; with use_orig_params=True
    (each parameter keeps its own step) the same disagreement is a FAIL."""
    from conformance.areas.checkpoint.observation import CkptObservation
    from conformance.run.runner import evaluate

    spec = _two_linears(CheckpointPlan(steps=2, refreeze=("proj0.weight",), load_frozen=(), save_world=2, load_world=2,
                                       load_plan=WrapPlan(api="fsdp1", use_orig_params=uop)))
    obs = [CkptObservation(kind="roundtrip", api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0",
                           optim_diff=(diff,)) for r, diff in enumerate(("proj0.weight.step", "proj1.weight.step"))]
    res = evaluate("CKPT-RESHARD", spec, obs)
    ranks_known = [fid for v, fid in res.known if v.invariant == "RANKS-AGREE"]
    ranks_failed = [v for v in res.violations if v.invariant == "RANKS-AGREE"]
    if uop:
        assert ranks_failed and not ranks_known, res.describe()
    else:
        assert ranks_known == ["fsdp1-flat-param-optim-load-merges-step"] and not ranks_failed, res.describe()


def test_uneven_steps_in_separate_units_are_not_merged():
    """ModuleWrapPolicy({Linear}): proj0 and proj1 are units of their own, each
    flat parameter has one step count."""
    from conformance.case.spec import ModuleWrap

    spec = _two_linears(CheckpointPlan(steps=2, refreeze=("proj0.weight",), load_frozen=(),
                                       load_plan=WrapPlan(api="fsdp1", policy=ModuleWrap(classes=("Linear",)))))
    assert predict_ckpt(spec).uneven_steps_in_load_unit is False


def test_a_diverged_reference_is_not_compared_after_the_resume():
    """Seed 2601: squared loss through a chain of Linears reaches 4.7e18
    after four SGD steps; the resumed run on 3 ranks and the reference then
    differ by 1% from summation order alone. The resume comparison is
    skipped once the reference's parameters leave DIVERGED times their
    initial size or stop being finite; a bounded reference is compared."""
    import torch

    from conformance.areas.checkpoint.adapter import _diverged

    spec = _two_linears(CheckpointPlan(steps=2))
    ok = {"proj0.weight": torch.full((4, 4), 3.0), "proj1.weight": torch.zeros(4, 4)}
    assert not _diverged(spec, ok)
    assert _diverged(spec, {**ok, "proj1.weight": torch.full((4, 4), 4.7e18)})
    assert _diverged(spec, {**ok, "proj0.weight": torch.full((4, 4), float("nan"))})


def test_paramless_fsdp1_root_and_buffers_only_keys():
    """root-unit:no-params: every parameter in a child unit (seed 2602); a
    non-zero rank holding only buffers is tagged keys:buffers-only, one that
    holds a parameter is not (fsdp1-rank0-only-no-shard-unit-keys)."""
    from conformance.areas.checkpoint.invariants import check_full
    from conformance.areas.checkpoint.observation import CkptObservation
    from conformance.case.spec import BufferSpec, ModuleWrap

    tree = ModuleSpec("", "Model", buffers=(BufferSpec("running", (1,)),), children=(
        ModuleSpec("proj0", "Linear", (ParamSpec("weight", (2, 2)),)),))
    ck = CheckpointPlan(full_sd="fsdp1-full", rank0_only=True)
    spec = CaseSpec(tree=tree, classes=(ClassSpec("Model"),), plan=WrapPlan(api="fsdp1", policy=ModuleWrap(("Linear",))), ckpt=ck)
    pred = predict_ckpt(spec)
    assert pred.fsdp1_paramless_root and "root-unit:no-params" in case_tags(spec, pred)
    root_only = dataclasses.replace(spec, plan=WrapPlan(api="fsdp1"))
    assert not predict_ckpt(root_only).fsdp1_paramless_root
    obs = [CkptObservation(kind="sd-full", api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="x", keys=keys)
           for r, keys in ((0, ("proj0.weight", "running")), (1, ("running",)))]
    [v] = check_full(spec, pred, obs)
    assert {"kind:nonzero-rank-keys", "keys:buffers-only"} <= v.tags
    obs[1] = dataclasses.replace(obs[1], keys=("proj0.weight", "running"))
    [v] = check_full(spec, pred, obs)
    assert "kind:nonzero-rank-keys" in v.tags and "keys:buffers-only" not in v.tags


@pytest.mark.parametrize("order,reversed_", [(("3", "2"), True), (("2", "3"), False)])
def test_a_crash_of_a_tied_reversed_list_group_save_is_known(order, reversed_):
    """Seed 2607: everything frozen, fully_shard(['3', '2'],
    reshard_after_forward=False) holding 2.weight = 3.weight; the save's rank
    died (SIGSEGV). The engine CRASH is matched on the case's tags (the
    oracle's included); listed in registration order it is not this finding."""
    import torch

    from conformance.areas.checkpoint.invariants import failure_tags
    from conformance.areas.checkpoint.oracle import predict_ckpt
    from conformance.case.spec import ShardGroup
    from conformance.case.violation import Violation
    from conformance.run import known

    tree = ModuleSpec("", "ModelSeq", children=tuple(ModuleSpec(str(i), "Linear", (ParamSpec("weight", (7, 7), False),)) for i in range(4)))
    spec = CaseSpec(tree=tree, classes=(ClassSpec("ModelSeq", "Sequential"),), ties=(TiedParam("2", "weight", "3.weight"),),
                    plan=WrapPlan(api="fsdp2", groups=(ShardGroup(order, False),)), ckpt=CheckpointPlan(steps=1))
    tags = failure_tags(spec, predict_ckpt(spec), spec.ckpt.save_world)
    assert ("group:multi-no-reshard-tie-reversed" in tags) is reversed_ and "no-backward-before-save" in tags
    v = Violation("CKPT-RESHARD", "CRASH: rank 1 killed by signal 11", frozenset(tags | {"kind:crash"}))
    entry = next(e for e in known.load() if e.id == "fsdp2-tied-list-group-unsharded-save-segfault")
    if not known.in_range(torch.__version__, entry.torch):
        pytest.skip(f"recorded for torch {entry.torch}")
    k = known.match(v, known.load(), torch.__version__)
    assert (k is not None and k.id == entry.id) is reversed_


def test_a_list_group_reached_first_through_a_shared_name_is_the_segfault_finding():
    """fsdp2-tied-list-group-unsharded-save-segfault (thorough seed
    914417134, torch 2.13.0, gloo: rank 0 killed by signal 11 in the save):
    fully_shard([proj0, proj1], reshard_after_forward=False) over a tie,
    listed in registration order, but proj1 is registered earlier under
    model0.model0 as shared0, so the state dict's traversal reaches proj1
    before proj0, whose hook is the group's. Tagged, its CRASH is KNOWN;
    without that shared name it saves (`check`: PASS), is not tagged, and
    the same CRASH stays a failure."""
    from pathlib import Path

    from conformance.areas.checkpoint.invariants import failure_tags
    from conformance.case.violation import Violation
    from conformance.run import known

    spec = CaseSpec.from_json((Path(__file__).parent / "data" / "ckpt-list-group-shared-name-reached-first-segfault.json").read_text())
    assert [g.modules for g in spec.plan.groups] == [("model0.model1.proj0", "model0.model1.proj1")]
    no_alias = dataclasses.replace(spec, shared=tuple(s for s in spec.shared if s.parent != "model0.model0"))

    def crash(case):
        tags = failure_tags(case, predict_ckpt(case), case.ckpt.save_world)
        v = Violation("CKPT-RESHARD", "CRASH: scenario 'ckpt-save' on 2 gloo ranks", frozenset(tags | {"kind:crash"}))
        return tags, known.match(v, known.load(), "2.13.0")

    tags, match = crash(spec)
    assert "group:multi-no-reshard-tie-reversed" in tags and match is not None
    assert match.id == "fsdp2-tied-list-group-unsharded-save-segfault"
    tags, match = crash(no_alias)
    assert "group:multi-no-reshard-tie-reversed" not in tags and match is None
