"""The thorough profile's FAIL rows that were recorded findings in forms the
areas did not tag (torch 2.13.0, gloo).

Thorough seed 71 FAILed three rows whose deviations
are recorded findings' own mechanisms, in forms the areas did not tag:
- MP-DTYPES and ACCUM: fully_shard([model1.model0.embed1, proj0]) where a
  freeze change freezes the Embedding (tied to proj0.weight) at step 1 only;
  the Embedding, run last, completes the group, and step 1's backward raised
  "setStorage ... storage of size 0": fsdp2-frozen-list-group-freed-in-backward
  (the schedule area now reads each step's own mask; step 0 trains);
- TP-PARITY: fully_shard([model1.layers1.0, model1.layers1.1]) on a (2, 2)
  mesh, the frozen Embedding layers1.1 run last: the same finding (the tp
  area now carries the group's tag and names the freed-storage error; with
  the group's weights trainable it trains);
- CKPT-RESHARD and OPTIM-STATE: a non-root group given
  reshard_after_forward=False, unfrozen after a first step in which nothing
  trains: its sharded parameter stays frozen, gets no optimizer state, and
  the resume asks for it ("Missing key in checkpoint state_dict:
  optim.state.model1.proj0.weight.momentum_buffer"):
  fsdp2-frozen-root-forward-leaves-params-unsharded's mechanism (with
  reshard_after_forward=True the case passes).
The area's re-run (seed 71 again, after those changes): MP-DTYPES and ACCUM
on fully_shard([model1.model0.embed0, proj0], reshard_after_forward=False),
proj0 run three times (two shared names), the Embedding frozen at step 1
through its tie: the re-runs' post-backward reshards the weight proj0's first
run's backward reads ("setStorage ... storage of size 0"):
fsdp2-list-group-reentered-loses-grad (its Linear form; without the re-runs,
or with the Embedding trainable, it trains).
Thorough seed 72: CKPT-RESHARD and OPTIM-STATE on fully_shard([3, 2]) with
2.weight tied to the Embedding 3's, trainable at the save and frozen at the
load: the training after the save under the mask at load (the save side's
continued run) raised "setStorage ... storage of size 0". The Embedding,
run last, completes the group: fsdp2-frozen-list-group-freed-in-backward
under the load's mask (the checkpoint area tagged the save's mask only;
with the Embedding trainable at load the run goes on).
The same errors where the mechanism is absent match neither."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.areas.checkpoint.observation import CkptObservation
from conformance.areas.schedule.observation import ScheduleObservation
from conformance.areas.tp.observation import TpObservation
from conformance.case.model_case import case_from_json
from conformance.run.runner import evaluate

pytestmark = pytest.mark.selfcheck

DATA = Path(__file__).parent / "data"
SCHEDULE = case_from_json((DATA / "schedule-embedding-frozen-at-step-1.json").read_text())
RERUN = case_from_json((DATA / "schedule-unresharded-group-rerun-after-embedding.json").read_text())
TP = case_from_json((DATA / "tp-frozen-embedding-completes-group.json").read_text())
CKPT = case_from_json((DATA / "ckpt-unfrozen-in-unresharded-group.json").read_text())
CKPT_AT_LOAD = case_from_json((DATA / "ckpt-embedding-frozen-at-load-list-group.json").read_text())
FREED = "RuntimeError: setStorage: sizes [6, 4], strides [4, 1], storage offset 0, and itemsize 4 requiring a storage size of 96 are out of bounds for storage of size 0"
MISSING = "CheckpointException: rank 0: RuntimeError: Missing key in checkpoint state_dict: optim.state.model1.proj0.weight.momentum_buffer."
FREED_LIST_GROUP = "fsdp2-frozen-list-group-freed-in-backward"


def _known(res) -> set[str]:
    return {fid for _, fid in res.known}


def _schedule(spec, invariant):
    obs = [ScheduleObservation(api="fsdp2", rank=r, world_size=2, backend="gloo", torch_version="2.13.0",
                               step_error=f"step 1 microbatch 0: {FREED}") for r in range(2)]
    return evaluate(invariant, spec, obs)


@pytest.mark.parametrize("invariant", ["MP-DTYPES", "ACCUM"])
def test_an_embedding_frozen_at_a_later_step_completing_the_group_is_that_finding(invariant):
    steps = SCHEDULE.schedule.steps
    assert steps[0].frozen == ("proj0.bias",) and "proj0.weight" in steps[1].frozen  # proj0.weight is embed1's weight too
    res = _schedule(SCHEDULE, invariant)
    assert res.verdict == "KNOWN" and _known(res) == {FREED_LIST_GROUP}, res.describe()
    # the Embedding trainable in every step: not that mechanism
    never = dataclasses.replace(steps[1], frozen=("proj0.bias",))
    other = _schedule(dataclasses.replace(SCHEDULE, schedule=dataclasses.replace(SCHEDULE.schedule, steps=(steps[0], never))), invariant)
    assert other.verdict == "FAIL", other.describe()


@pytest.mark.parametrize("invariant", ["MP-DTYPES", "ACCUM"])
def test_a_rerun_after_a_frozen_embedding_reading_a_resharded_weight_is_the_reentered_finding(invariant):
    assert RERUN.plan.groups[0].reshard_after_forward is False and len(RERUN.shared) == 2
    res = _schedule(RERUN, invariant)
    assert res.verdict == "KNOWN" and _known(res) == {"fsdp2-list-group-reentered-loses-grad"}, res.describe()
    # no re-run (the shared names gone): not that mechanism
    other = _schedule(dataclasses.replace(RERUN, shared=()), invariant)
    assert other.verdict == "FAIL", other.describe()


def _tp(spec):
    obs = [TpObservation(api="fsdp2", rank=r, world_size=4, backend="gloo", torch_version="2.13.0", step_error=FREED) for r in range(4)]
    return evaluate("TP-PARITY", spec, obs)


def _trainable(spec, paths):
    def walk(m, path):
        params = tuple(dataclasses.replace(p, requires_grad=True) if path in paths else p for p in m.params)
        return dataclasses.replace(m, params=params, children=tuple(walk(c, f"{path}.{c.name}" if path else c.name) for c in m.children))

    return dataclasses.replace(spec, tree=walk(spec.tree, ""))


def test_the_tp_training_over_a_group_completed_by_a_frozen_embedding_is_that_finding():
    assert TP.plan.groups[0].modules == ("model1.layers1.0", "model1.layers1.1")
    res = _tp(TP)
    assert res.verdict == "KNOWN" and _known(res) == {FREED_LIST_GROUP}, res.describe()
    other = _tp(_trainable(TP, {"model1.layers1.0", "model1.layers1.1"}))
    assert other.verdict == "FAIL", other.describe()


def _ckpt(spec, invariant, error=MISSING, phase="load"):
    obs = [CkptObservation(kind="roundtrip", api="fsdp2", rank=r, world_size=2, backend="gloo", torch_version="2.13.0",
                           error=error, phase=phase) for r in range(2)]
    return evaluate(invariant, spec, obs)


@pytest.mark.parametrize("invariant", ["CKPT-RESHARD", "OPTIM-STATE"])
def test_unfreezing_in_a_group_left_unsharded_by_a_forward_is_that_finding(invariant):
    assert CKPT.plan.groups[1] == dataclasses.replace(CKPT.plan.groups[1], modules=("model1.proj0",), reshard_after_forward=False)
    assert CKPT.ckpt.refreeze == ("model1.proj0.weight",)
    res = _ckpt(CKPT, invariant)
    assert res.verdict == "KNOWN" and _known(res) == {"fsdp2-frozen-root-forward-leaves-params-unsharded"}, res.describe()
    # the group resharded after forward: requires_grad_ reaches the sharded parameter, the case passes on torch
    groups = (CKPT.plan.groups[0], dataclasses.replace(CKPT.plan.groups[1], reshard_after_forward=True))
    other = _ckpt(dataclasses.replace(CKPT, plan=dataclasses.replace(CKPT.plan, groups=groups)), invariant)
    assert other.verdict == "FAIL", other.describe()


@pytest.mark.parametrize("invariant", ["CKPT-RESHARD", "OPTIM-STATE"])
def test_the_training_after_the_save_under_the_load_mask_is_the_freed_list_group_finding(invariant):
    freed = FREED.replace("[6, 4], strides [4, 1]", "[1, 1], strides [1, 1]").replace("size of 96", "size of 4")
    assert CKPT_AT_LOAD.plan.groups[0].modules == ("3", "2") and CKPT_AT_LOAD.ckpt.load_frozen == ("3.weight",)
    res = _ckpt(CKPT_AT_LOAD, invariant, freed, "resume")
    assert res.verdict == "KNOWN" and _known(res) == {FREED_LIST_GROUP}, res.describe()
    trainable = dataclasses.replace(CKPT_AT_LOAD, ckpt=dataclasses.replace(CKPT_AT_LOAD.ckpt, load_frozen=()))
    other = _ckpt(trainable, invariant, freed, "resume")
    assert other.verdict == "FAIL", other.describe()


# Thorough seed 84 (MP-DTYPES, ACCUM; FSDP1, ModuleWrapPolicy(Model)): the
# unit model1, its one parameter frozen, passes over its Linear in the
# microbatch and returns its input; its reshard-only hook (on that input)
# fires before its pre-backward hook (on the same tensor, its output):
# "expected to be in states [IDLE] but current state is FORWARD_BACKWARD"
# (fsdp1-frozen-unit-returning-its-input-fails-backward, a new finding; its
# repro shows it on one rank and two, and trains where the Linear runs)
PASSTHROUGH = case_from_json((DATA / "schedule-frozen-unit-passes-input-through.json").read_text())
STATE = "ValueError: expected to be in states [<TrainingState.IDLE: 1>] but current state is TrainingState.FORWARD_BACKWARD"


def _fsdp1_schedule(spec, invariant, error=STATE):
    obs = [ScheduleObservation(api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0",
                               step_error=f"step 0 microbatch 0: {error}") for r in range(2)]
    return evaluate(invariant, spec, obs)


def _with_microbatch(spec, **changes):
    st = spec.schedule.steps[0]
    st = dataclasses.replace(st, microbatches=(dataclasses.replace(st.microbatches[0], **changes),))
    return dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, steps=(st,)))


@pytest.mark.parametrize("invariant", ["MP-DTYPES", "ACCUM"])
def test_a_frozen_unit_returning_its_input_is_that_finding(invariant):
    from conformance.areas.schedule.invariants import case_tags
    from conformance.areas.schedule.oracle import predict_schedule

    assert PASSTHROUGH.schedule.steps[0].microbatches[0].skip == ("model1.proj0",)
    assert "unit:frozen-passthrough" in case_tags(PASSTHROUGH, predict_schedule(PASSTHROUGH))
    res = _fsdp1_schedule(PASSTHROUGH, invariant)
    assert res.verdict == "KNOWN" and _known(res) == {"fsdp1-frozen-unit-returning-its-input-fails-backward"}, res.describe()
    # the unit runs its Linear: it returns a new tensor, not that mechanism
    runs = _with_microbatch(PASSTHROUGH, skip=())
    assert "unit:frozen-passthrough" not in case_tags(runs, predict_schedule(runs))
    assert _fsdp1_schedule(runs, invariant).verdict == "FAIL"
    # the unit's parameter trainable: no reshard-only hook on the input
    trainable = dataclasses.replace(PASSTHROUGH, tree=_requires_grad(PASSTHROUGH.tree, "model1.proj0", True),
                                    schedule=dataclasses.replace(PASSTHROUGH.schedule, steps=(
                                        dataclasses.replace(PASSTHROUGH.schedule.steps[0], frozen=()),)))
    assert "unit:frozen-passthrough" not in case_tags(trainable, predict_schedule(trainable))
    # another error of the same case: not that finding
    assert _fsdp1_schedule(PASSTHROUGH, invariant, "RuntimeError: something else").verdict == "FAIL"


def _requires_grad(tree, path, value):
    def walk(m, prefix):
        here = f"{prefix}.{m.name}" if prefix and m.name else (m.name or prefix)
        params = tuple(dataclasses.replace(p, requires_grad=value) if here == path else p for p in m.params)
        return dataclasses.replace(m, params=params, children=tuple(walk(c, here) for c in m.children))
    return walk(tree, "")


# Thorough seed 92: CKPT-RESHARD and OPTIM-STATE on a frozen root weight tied
# to block0.tied0, a trainable Linear its own unit, saved on two ranks and
# loaded with use_orig_params=True on one (NO_SHARD): the training after the
# load raised "as_params=True type(prim_param)=<class 'torch.Tensor'>".
# fsdp1-no-shard-frozen-unit-params-unregistered's mechanism (the frozen
# unit's parameters left plain Tensor views), reaching a shared parameter;
# checked: without the tie, or with the root weight trainable, it passes.
TIED_ROOT = case_from_json((DATA / "ckpt-frozen-tied-root-resumed-on-one-rank.json").read_text())
AS_PARAMS = "AssertionError: as_params=True type(prim_param)=<class 'torch.Tensor'>"


def _ckpt1(spec, invariant, error, phase):
    obs = [CkptObservation(kind="roundtrip", api="fsdp1", rank=0, world_size=2, backend="gloo", torch_version="2.13.0",
                           error=error, phase=phase)]
    return evaluate(invariant, spec, obs)


@pytest.mark.parametrize("invariant", ["CKPT-RESHARD", "OPTIM-STATE"])
def test_a_frozen_tied_unit_resumed_on_one_rank_is_the_no_shard_finding(invariant):
    assert TIED_ROOT.ckpt.load_world == 1 and TIED_ROOT.ckpt.load_plan.use_orig_params and TIED_ROOT.ties
    res = _ckpt1(TIED_ROOT, invariant, AS_PARAMS, "resume")
    assert res.verdict == "KNOWN" and _known(res) == {"fsdp1-no-shard-frozen-unit-params-unregistered"}, res.describe()
    # another AssertionError of the same case: not that finding
    assert _ckpt1(TIED_ROOT, invariant, "AssertionError: something else", "resume").verdict == "FAIL"
    # loaded on two ranks (FULL_SHARD really shards): not that mechanism
    two = dataclasses.replace(TIED_ROOT, ckpt=dataclasses.replace(TIED_ROOT.ckpt, load_world=2))
    assert _ckpt1(two, invariant, AS_PARAMS, "resume").verdict == "FAIL"


# Thorough seed 3683: CKPT-RESHARD and OPTIM-STATE on fully_shard([model0.embed1,
# model0.model2.proj0]) where model0 runs twice (the root's shared0) and proj0
# twice in each run (model0.shared0 is model2): the frozen Embedding completes
# the group before a re-run, and the save side's first training step raised
# "setStorage ... storage of size 0". fsdp2-list-group-reentered-loses-grad's
# mechanism, which the checkpoint area did not tag (it kept the list-group tags
# of fsdp2-frozen-list-group-freed-in-backward only); checked with its torch-only
# repro on one rank: without either shared name, or with the Embedding
# trainable, it trains.
RERUN_CKPT = case_from_json((DATA / "ckpt-group-rerun-after-frozen-embedding.json").read_text())
FREED_1x1 = FREED.replace("[6, 4], strides [4, 1]", "[1, 1], strides [1, 1]").replace("size of 96", "size of 4")


@pytest.mark.parametrize("invariant", ["CKPT-RESHARD", "OPTIM-STATE"])
def test_the_save_sides_training_over_a_group_rerun_after_a_frozen_embedding_is_the_reentered_finding(invariant):
    assert RERUN_CKPT.plan.groups[0].modules == ("model0.embed1", "model0.model2.proj0") and len(RERUN_CKPT.shared) == 2
    res = _ckpt(RERUN_CKPT, invariant, FREED_1x1, "train")
    assert res.verdict == "KNOWN" and _known(res) == {"fsdp2-list-group-reentered-loses-grad"}, res.describe()
    # without the root's shared name model0 runs once: no re-run after the Embedding completed the group
    once = dataclasses.replace(RERUN_CKPT, shared=tuple(s for s in RERUN_CKPT.shared if s.parent != ""))
    assert _ckpt(once, invariant, FREED_1x1, "train").verdict == "FAIL"
    # the Embedding trainable: its output needs a gradient, not that mechanism
    tree = _requires_grad(_requires_grad(RERUN_CKPT.tree, "model0.embed1", True), "model0.model2.proj0", True)  # proj0.weight is its tie
    trainable = dataclasses.replace(RERUN_CKPT, tree=tree)
    assert _ckpt(trainable, invariant, FREED_1x1, "train").verdict == "FAIL"
    # another error of the same case: not that finding
    assert _ckpt(RERUN_CKPT, invariant, "RuntimeError: something else", "train").verdict == "FAIL"


# Thorough seed 195964: MP-DTYPES, MP-PIPELINE and ACCUM (FSDP1, gloo) on
# Sequential(Embedding, frozen Linear), the Linear its own NO_SHARD unit,
# use_orig_params=True: step 0's microbatch that skips the Embedding runs the
# all-frozen unit in a forward no backward follows; it registers the
# reshard-only hook state on inputs needing no gradient, the next
# microbatch's forward finds it registered and registers none, and the unit
# is left holding plain-tensor views (_catch_all_reshard passes NO_SHARD
# over); unfrozen at step 2, 1.weight's gradient misses the optimizer's
# parameter (lost: None in a torch-only reduction on one rank and two).
# fsdp1-no-shard-frozen-unit-params-unregistered's end state, reached through
# the stale hook state instead of an input needing no gradient.
LEFT = "unit:no-shard-frozen-left-unsharded"


def _stale_case():
    from conformance.run import corpus

    return next(c.spec for c in corpus.load() if c.name == "fsdp1-no-shard-frozen-unit-params-unregistered-stale-reshard-hook")


def _schedule_tags(spec, world_size=2):
    from conformance.areas.schedule.invariants import case_tags
    from conformance.areas.schedule.oracle import predict_schedule

    return case_tags(spec, predict_schedule(spec), world_size)


def test_a_frozen_no_shard_unit_run_forward_only_then_with_a_backward_is_left_unsharded():
    from conformance.case.spec import CustomWrap, Microbatch

    spec = _stale_case()
    steps = spec.schedule.steps
    assert [mb.skip for mb in steps[0].microbatches] == [(), ("0",), ()] and steps[0].frozen == ("1.weight",) and steps[2].frozen == ()
    assert LEFT in _schedule_tags(spec)
    # the Embedding runs in every microbatch (no forward-only one): torch trains, no tag
    every = dataclasses.replace(steps[0], microbatches=tuple(Microbatch(skip=()) for _ in steps[0].microbatches))
    assert LEFT not in _schedule_tags(dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, steps=(every, *steps[1:]))))
    # use_orig_params=False: no tag (torch trains)
    assert LEFT not in _schedule_tags(dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, use_orig_params=False)))
    # the unit FULL_SHARD: resharded after forward on two ranks (torch trains); one rank runs it as NO_SHARD
    full = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, policy=CustomWrap(targets=("1",))))
    assert LEFT not in _schedule_tags(full) and LEFT in _schedule_tags(full, world_size=1)
    # never unfrozen: nothing reads the views
    frozen = dataclasses.replace(steps[2], frozen=("1.weight",))
    assert LEFT not in _schedule_tags(dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, steps=(*steps[:2], frozen))))


def test_the_left_unsharded_finding_takes_a_lost_gradient_not_a_rounding():
    import torch

    from conformance.areas.common.violations import violation
    from conformance.run import known

    spec = _stale_case()
    tags = _schedule_tags(spec) | {"backend:gloo"}
    lost = violation("MP-PIPELINE", "step 2: gradient of 1.weight differs from the emulated pipeline's by 0.671", tags, "kind:grad", "off:large")
    assert known.match(lost, known.load(), torch.__version__).id == "fsdp1-no-shard-frozen-unit-params-unregistered"
    rounding = violation("MP-PIPELINE", "step 0: gradient of 0.weight differs from the emulated pipeline's by 3.79e-06", tags, "kind:grad", "off:rounding")
    assert known.match(rounding, known.load(), torch.__version__) is None
