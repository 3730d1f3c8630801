"""Every checkpoint invariant catches a fault injected inside the ranks, and
the engine reports an unwritable checkpoint directory, a rank that hangs in
the load and a rank that dies in the save (HANG / CRASH with stacks), goes
on, and leaves no temporary checkpoint behind.

Each value test shows the hand-written case holds on unmodified torch, then
runs it through a test-only scenario that applies one regression inside the
ranks (tests/self/faults_checkpoint.py)."""

from __future__ import annotations

import dataclasses
import os

import pytest

# the driver checks scenario names too: register the fault scenarios here as well
import tests.self.faults_checkpoint  # noqa: E402,F401
from conformance.areas.checkpoint.observation import CkptObservation
from conformance.case.spec import (
    BufferSpec,
    CaseSpec,
    CheckpointPlan,
    ClassSpec,
    ModuleSpec,
    ModuleWrap,
    ParamSpec,
    Precision,
    ShardGroup,
    TiedParam,
    WrapPlan,
)
from conformance.run.runner import FAIL, PASS, evaluate, observations

pytestmark = [pytest.mark.selfcheck, pytest.mark.gloo]

SCENARIO = {"SD-FULL": "ckpt-full", "TIES-KEPT": "ckpt-ties", "CKPT-RESHARD": "ckpt-roundtrip", "OPTIM-STATE": "ckpt-roundtrip"}


def lm(ckpt: CheckpointPlan, *, frozen_bias: bool = True) -> CaseSpec:
    """embed, block (w; proj0 with a bias frozen unless told), head tied to
    embed.weight; FSDP2 with block as its own group. Dimensions 5 and 3 do
    not divide evenly over 2 ranks."""
    block = ModuleSpec("block", "Block", (ParamSpec("w", (3,)),), children=(
        ModuleSpec("proj0", "Linear", (ParamSpec("weight", (3, 3)), ParamSpec("bias", (3,), not frozen_bias))),
    ))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(
        ModuleSpec("embed", "Embedding", (ParamSpec("weight", (5, 3)),)), block,
        ModuleSpec("head", "Linear", (ParamSpec("weight", (5, 3)),)),
    ))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), ties=(TiedParam("head", "weight", "embed.weight"),),
                    plan=WrapPlan(api="fsdp2", groups=(ShardGroup(("block",)),)), ckpt=ckpt, seed=3)


def mixed(api: str) -> CaseSpec:
    """A checkpoint of a model in use under mixed precision: the root's
    scale and a Block's w, a buffer in Block and one in proj0; FSDP1 with
    Block as a unit and every buffer in a unit that manages parameters
    (FULL_STATE_DICT, bf16 parameters and buffers), FSDP2 with the root a
    group that keeps its parameters unsharded after the forward."""
    block = ModuleSpec("block", "Block", (ParamSpec("w", (3,)),), (BufferSpec("running", (3,)),), children=(
        ModuleSpec("proj0", "Linear", (ParamSpec("weight", (3, 3)), ParamSpec("bias", (3,)))),
    ))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), (BufferSpec("running", (3,)),), children=(block,))
    if api == "fsdp1":
        plan = WrapPlan(api="fsdp1", policy=ModuleWrap(("Block",)))
        ck = CheckpointPlan(full_sd="fsdp1-full", warm=True, precision=Precision(param_dtype="bfloat16", buffer_dtype="bfloat16"))
    else:
        plan = WrapPlan(api="fsdp2", groups=(ShardGroup(("block",)),))
        ck = CheckpointPlan(full_sd="dcp-full", warm=True, precision=Precision(param_dtype="bfloat16"))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), plan=plan, ckpt=ck, seed=3)


def loaded_mixed(api: str) -> CaseSpec:
    """lm's model, bf16 compute, one forward, then load_state_dict of a full
    state dict (FSDP1: use_orig_params=True, Block a unit)."""
    spec = lm(CheckpointPlan(load_path="load_state_dict", warm=True, precision=Precision(param_dtype="bfloat16")))
    if api == "fsdp1":
        spec = dataclasses.replace(spec, plan=WrapPlan(api="fsdp1", use_orig_params=True, policy=ModuleWrap(("Block",))))
    return spec


ROUNDTRIP = CheckpointPlan(save_world=2, load_world=2, load_plan=WrapPlan(api="fsdp1", use_orig_params=True), optimizer="Adam", steps=2, steps_after=1)
ROUNDTRIP_FSDP2 = dataclasses.replace(ROUNDTRIP, load_plan=WrapPlan(api="fsdp2"))
TWO_GROUPS = dataclasses.replace(ROUNDTRIP_FSDP2, param_groups=2)


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(2)


def worlds(pool, phases=None, deadline=20.0):
    from conformance.engine.worlds import Worlds

    return Worlds(pool, phases=phases, deadline=deadline)


def run(invariant, spec, engine, scenario=None):
    obs = observations(engine, spec, scenario or SCENARIO[invariant], CkptObservation.from_dict)
    return evaluate(invariant, spec, obs)


def assert_caught(res, kind):
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


VALUES = [
    ("SD-FULL", lm(CheckpointPlan(full_sd="dcp-full")), "fault:ckpt-full:full-sd-perturbed", None, "kind:values"),
    ("SD-FULL", lm(CheckpointPlan(full_sd="dcp-full", ignore_frozen=True)), "fault:ckpt-full:frozen-not-ignored", None, "kind:frozen-kept"),
    # under mixed precision after a forward: a dtype is structure, checked on every tier
    ("SD-FULL", mixed("fsdp1"), "fault:ckpt-full:buffers-not-upcast", None, "kind:dtype"),
    ("SD-FULL", mixed("fsdp1"), "fault:ckpt-full:params-unsharded-low-precision", None, "kind:dtype"),
    ("SD-FULL", mixed("fsdp2"), "fault:ckpt-full:fsdp2-state-dict-not-resharded", None, "kind:dtype"),
    ("TIES-KEPT", lm(CheckpointPlan(load_path="set_model_state_dict")), "fault:ckpt-ties:load-assigns", None, "kind:untied"),
    # untied: assign=True unties a tie (the finding load-state-dict-assign-unties)
    ("TIES-KEPT", dataclasses.replace(lm(CheckpointPlan(load_path="load_state_dict-assign")), ties=()),
     "fault:ckpt-ties:lazy-init-keeps-old-shards", None, "kind:forward-stale"),
    ("TIES-KEPT", dataclasses.replace(lm(CheckpointPlan(load_path="load_state_dict-assign", warm=True)), ties=()),
     "fault:ckpt-ties:load-post-hook-keeps-old-shards", None, "kind:forward-stale"),
    # under mixed precision, into a model that ran: the next forward casts
    # the loaded full-precision values again (a param_dtype copy kept from
    # before the load computes with the old ones)
    ("TIES-KEPT", loaded_mixed("fsdp1"), "fault:ckpt-ties:fsdp1-low-precision-shard-kept", None, "kind:forward-stale"),
    ("TIES-KEPT", loaded_mixed("fsdp2"), "fault:ckpt-ties:fsdp2-cast-shard-kept", None, "kind:forward-stale"),
    pytest.param("CKPT-RESHARD", lm(ROUNDTRIP), "ckpt-roundtrip", ("ckpt-save", "fault:ckpt-load:load-skips-model"), "kind:model"),
    # the saved hyperparameters (a learning-rate schedule's step before the
    # save) restored to the right groups: the optimizer as training scripts
    # build it, the matrices and the rest at another learning rate
    pytest.param("CKPT-RESHARD", lm(TWO_GROUPS), "ckpt-roundtrip", ("ckpt-save", "fault:ckpt-load:hyperparameters-as-built"), "kind:param-groups"),
    pytest.param("CKPT-RESHARD", lm(TWO_GROUPS), "ckpt-roundtrip", ("ckpt-save", "fault:ckpt-load:param-groups-hyperparameters-reversed"), "kind:param-groups"),
    # FSDP2 at the load: FSDP1's get_optimizer_state_dict raises for a
    # parameter without state (a red verdict too, but not the kind asked for)
    pytest.param("OPTIM-STATE", lm(ROUNDTRIP_FSDP2), "ckpt-roundtrip", ("ckpt-save", "fault:ckpt-load:optim-state-dropped"), "kind:lost-at-load"),
    # the values compared with single-process training (within the reference's
    # own rounding noise): a reduce-scatter that sums where it averages
    pytest.param("OPTIM-STATE", lm(ROUNDTRIP_FSDP2), "ckpt-roundtrip", ("fault:ckpt-save:grads-summed", "ckpt-load"), "kind:state-value"),
    pytest.param("OPTIM-STATE", lm(ROUNDTRIP_FSDP2), "ckpt-roundtrip", ("fault:ckpt-save:grads-summed", "ckpt-load"), "kind:resume-reference"),
]


def _id(v) -> str:
    v = v.values if hasattr(v, "values") else v
    return f"{v[0]}-{v[2].rsplit(':', 1)[-1] if v[3] is None else v[3][1].rsplit(':', 1)[-1]}"


@pytest.mark.parametrize("invariant,spec,scenario,phases,kind", VALUES, ids=[_id(v) for v in VALUES])
def test_value_fault_is_caught_inside_the_ranks(invariant, spec, scenario, phases, kind, pool):
    w = worlds(pool)
    res = run(invariant, spec, w)
    assert res.verdict == PASS, res.describe()
    w = worlds(pool, {"ckpt-roundtrip": phases} if phases else None)
    res = run(invariant, spec, w, scenario)
    assert_caught(res, kind)
    if invariant in ("CKPT-RESHARD", "OPTIM-STATE"):  # values after training: they name the backend
        assert all("backend:gloo" in v.tags for v in res.violations), res.describe()
    assert not any(os.path.exists(d) for d in w.dirs_made)


def test_unwritable_checkpoint_dir_is_reported_and_removed(pool):
    w = worlds(pool, {"ckpt-roundtrip": ("fault:ckpt-save:unwritable", "ckpt-load")})
    res = run("OPTIM-STATE", lm(ROUNDTRIP), w)
    assert_caught(res, "phase:save")
    assert w.dirs_made and not any(os.path.exists(d) for d in w.dirs_made)


@pytest.mark.parametrize("phases,verdict", [
    (("ckpt-save", "fault:ckpt-load:hang"), "HANG"),
    (("fault:ckpt-save:dies", "ckpt-load"), "CRASH"),
], ids=["load-hangs-one-rank", "rank-dies-in-save"])
def test_hang_or_crash_is_reported_and_the_run_goes_on(phases, verdict, pool):
    from conformance.run.session import Session

    session = Session()
    w = worlds(pool, {"ckpt-roundtrip": phases}, deadline=8.0)
    spec = lm(ROUNDTRIP)
    with pytest.raises(AssertionError, match=verdict):
        session.check("CKPT-RESHARD", spec, w, "gloo")
    tally = session.tally("CKPT-RESHARD", "gloo", "fsdp2")
    finding = tally.findings[verdict]
    ranks = finding.engine["ranks"]
    assert any(r["stack"] for r in ranks), finding.engine  # the stacks are in the report
    assert not any(os.path.exists(d) for d in w.dirs_made)
    # the pool was rebuilt: the next example runs
    assert session.check("CKPT-RESHARD", spec, worlds(pool), "gloo").verdict == PASS


def test_a_round_trip_checkpoints_in_the_scratch_directory(pool, tmp_path, monkeypatch):
    """The round trip's directory is made under FSDP_CONFORMANCE_SCRATCH
    (default: a RAM-backed directory, conformance.paths.scratch_root) and
    removed after its example."""
    from conformance import paths

    monkeypatch.setenv(paths.SCRATCH_ENV, str(tmp_path))
    w = worlds(pool)
    res = run("CKPT-RESHARD", lm(ROUNDTRIP), w)
    assert res.verdict == PASS, res.describe()
    assert [os.path.dirname(d) for d in w.dirs_made] == [str(tmp_path)]
    assert os.listdir(tmp_path) == []


def test_scratch_root_is_the_named_directory_else_a_writable_ram_one_else_tempfiles(tmp_path, monkeypatch):
    from conformance import paths

    monkeypatch.delenv(paths.SCRATCH_ENV, raising=False)
    monkeypatch.setattr(paths, "_RAM_DIRS", (str(tmp_path / "absent"), str(tmp_path)))
    assert paths.scratch_root() == str(tmp_path)
    assert paths.scratch_root(small=False) is None  # a real model's checkpoint: $TMPDIR
    monkeypatch.setattr(paths, "_RAM_MIN_FREE", paths._free(str(tmp_path)) + (1 << 40))
    assert paths.scratch_root() is None  # too little room (a container's 64 MiB /dev/shm)
    monkeypatch.setattr(paths, "_RAM_MIN_FREE", 1 << 30)
    monkeypatch.setattr(paths, "_RAM_DIRS", (str(tmp_path / "absent"),))
    assert paths.scratch_root() is None  # tempfile's own default ($TMPDIR)
    monkeypatch.setenv(paths.SCRATCH_ENV, str(tmp_path / "named"))
    assert paths.scratch_root() == paths.scratch_root(small=False) == str(tmp_path / "named")
    monkeypatch.setenv(paths.SCRATCH_ENV, "")
    assert paths.scratch_root() is None


def test_a_scratch_directory_of_a_process_no_longer_alive_is_removed(tmp_path, monkeypatch):
    """A killed run cannot remove its checkpoint directories: the next
    process's first scratch_dir removes those whose process is gone and
    which are ten minutes old, and only those (a live process's, a recent
    one, a name without a pid stay)."""
    import subprocess
    import sys
    import time

    from conformance import paths

    monkeypatch.setenv(paths.SCRATCH_ENV, str(tmp_path))
    monkeypatch.setattr(paths, "_swept", set())
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    prefix = "fsdp-conformance-ckpt-"
    old = time.time() - paths.STALE_AFTER - 60
    for name in (f"{prefix}{gone}-dead", f"{prefix}{gone}-recent", f"{prefix}{os.getpid()}-alive", f"{prefix}nopid", f"other-{gone}-x"):
        (tmp_path / name).mkdir()
        if not name.endswith("-recent"):
            os.utime(tmp_path / name, (old, old))
    made = paths.scratch_dir(prefix)
    assert os.path.basename(made).startswith(f"{prefix}{os.getpid()}-")
    # a recent one may be a live run's in another PID namespace: it stays
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{prefix}{gone}-recent", f"{prefix}{os.getpid()}-alive", f"{prefix}nopid", f"other-{gone}-x", os.path.basename(made)])


def test_a_real_model_round_trip_checkpoints_in_tmpdir_not_ram(tmp_path, monkeypatch):
    """A model case's checkpoint can be gigabytes: its directory is made in
    $TMPDIR, a drawn case's in the RAM directory."""
    import tempfile

    from conformance import paths
    from conformance.case.model_case import ModelCase
    from conformance.engine.worlds import Worlds

    ram, disk = tmp_path / "ram", tmp_path / "disk"
    ram.mkdir()
    disk.mkdir()
    monkeypatch.delenv(paths.SCRATCH_ENV, raising=False)
    monkeypatch.setattr(paths, "_RAM_DIRS", (str(ram),))
    monkeypatch.setattr(tempfile, "tempdir", str(disk))
    made = []

    def save_fails(world_size, scenario, spec, args=None):  # the save phase only: where its directory is
        made.append(os.path.dirname(args["dir"]))
        return [{"ok": False, "error": "stop here"}]

    w = Worlds(object())
    monkeypatch.setattr(w, "_run", save_fails)
    w.run("ckpt-roundtrip", ModelCase("conformance.models.toy_target:target", ckpt=ROUNDTRIP))
    w.run("ckpt-roundtrip", lm(ROUNDTRIP))
    assert made == [str(disk), str(ram)]
