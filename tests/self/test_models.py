"""Real models: the module graph, ModelCase, strategies over a
target, invariants on a target (with injected faults), the CLI, the Python
API and the pytest plugin on a target written outside the suite, bad input."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.areas.common.fsdp2_oracle import predict_fsdp2
from conformance.case.build import build
from conformance.case.graph import ModelGraph
from conformance.case.model_case import ModelCase, case_from_json
from conformance.case.spec import CustomWrap, ForwardMethod, ModuleWrap, ShardGroup, SpecError, TrainPlan, WrapPlan
from conformance.run.runner import FAIL, KNOWN, PASS, UNCHECKED, evaluate, observations
from conformance.strategies import case_specs
from conformance.strategies.targets import model_cases
from tests.self.model_target_source import SOURCE

pytestmark = pytest.mark.selfcheck

TOY = "conformance.models.toy_target:target"
ROOT = Path(__file__).resolve().parents[2]
FAST = settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))


# ---- the graph ---------------------------------------------------------------------


@FAST
@given(spec=case_specs())
def test_graph_from_spec_equals_graph_of_the_built_module(spec):
    """The oracle's graph of a CaseSpec is the graph of the module build.py
    makes from it: same modules, classes and MROs, parameters (shapes,
    requires_grad, every alias), shared-module paths, state-dict keys."""
    assert ModelGraph(spec).canonical() == ModelGraph(build(spec).model).canonical()


def test_graph_of_a_live_module_sees_ties_shared_modules_and_buffers():
    import torch.nn as nn

    class Block(nn.Linear):
        pass

    root = nn.Module()
    root.a = Block(2, 2)
    root.b = nn.Sequential(root.a, nn.Linear(2, 2))  # a shared module
    root.b[1].weight = root.a.weight  # a tie
    root.register_buffer("keep", nn.Parameter(nn.init.zeros_(nn.Linear(1, 1).weight)).data)
    root.register_buffer("scratch", root.keep.clone(), persistent=False)
    root.a.bias.requires_grad_(False)
    c = ModelGraph(root).canonical()
    assert c["modules"]["a"]["mro"] == ["Block", "Linear", "Module"]
    assert c["modules"]["a"]["aliases"] == ["a", "b.0"]
    assert c["params"]["a.weight"]["aliases"] == ["a.weight", "b.0.weight", "b.1.weight"]
    assert c["params"]["a.bias"] == {"shape": [2], "numel": 2, "requires_grad": False, "aliases": ["a.bias", "b.0.bias"]}
    assert c["state_dict"] == list(root.state_dict())  # the non-persistent buffer is not a key


# ---- ModelCase and strategies -------------------------------------------------------


@FAST
@given(case=model_cases(TOY))
def test_model_case_round_trips_through_json_and_python(case):
    assert case_from_json(case.to_json()) == case
    ns: dict = {}
    exec(case.to_python(), ns)
    assert ns["spec"] == case


@settings(FAST, max_examples=15)
@given(data=st.data())
@pytest.mark.parametrize("lifecycle", ["full", "ties", "roundtrip", "schedule"])
def test_lifecycle_model_cases_are_valid_and_promised(lifecycle, data):
    """Every drawn lifecycle case names only the model's own parameters,
    classes and modules, round-trips through JSON, and is one whose training
    FSDP promises (else its invariants would compare nothing)."""
    from conformance.case.target import check_case
    from conformance.strategies.targets import lifecycle_fits

    case = data.draw(model_cases(TOY, lifecycle=lifecycle))
    check_case(case)
    assert case_from_json(case.to_json()) == case
    assert lifecycle_fits(case)
    assert (case.ckpt is not None) == (lifecycle != "schedule") and (case.schedule is not None) == (lifecycle == "schedule")


def test_lifecycle_strategies_reach_what_they_promise():
    """The round trip loads under the other API on another world size with
    a freeze change, the target's own LoRA-like preset among the load masks;
    schedules mix precision, freeze changes and unsynced microbatches."""
    from conformance.strategies.targets import _model

    only_block1 = _model(TOY).frozen_for_trainable(lambda a: "blocks.1." in a)
    from hypothesis import Phase

    cfg = settings(database=None, max_examples=3000, suppress_health_check=list(HealthCheck), phases=[Phase.generate])  # found, not shrunk
    find(model_cases(TOY, lifecycle="roundtrip"), lambda c: c.ckpt.load_plan.api != c.plan.api and c.ckpt.load_world == 3
         and c.ckpt.save_world != 3 and bool(c.ckpt.refreeze), settings=cfg)
    find(model_cases(TOY, lifecycle="roundtrip"), lambda c: c.ckpt.load_frozen == only_block1, settings=cfg)
    find(model_cases(TOY, lifecycle="schedule"), lambda c: c.schedule.precision is not None and c.schedule.precision.param_dtype is not None
         and len({st.frozen for st in c.schedule.steps}) > 1 and any(len(st.microbatches) > 1 and not st.sync_every for st in c.schedule.steps),
         settings=cfg)
    find(model_cases(TOY, lifecycle="full"), lambda c: c.ckpt.full_sd == "fsdp1-full" and c.ckpt.rank0_only, settings=cfg)


def test_model_case_rejects_bad_data():
    with pytest.raises(SpecError, match="package.module:attr"):
        ModelCase("no-colon")
    with pytest.raises(SpecError, match="shard groups"):
        ModelCase(TOY, plan=WrapPlan("fsdp1", groups=(ShardGroup(("blocks.0",)),)))


def test_shrinking_ends_at_one_frozen_parameter_and_no_policy():
    """FSDP1 must reject a mixed unit (use_orig_params=False): the smallest
    case is one frozen parameter in the root unit, with no policy."""
    got = find(model_cases(TOY, apis=st.just("fsdp1")), lambda c: predict_fsdp1(c).error is not None,
               settings=settings(database=None, max_examples=2000, derandomize=True))
    assert got.frozen == ("embed.weight",) and got.plan.policy is None and not got.plan.use_orig_params


def test_shrinking_ends_at_one_class_and_one_frozen_parameter():
    """A mixed unit below the root: one frozen parameter of a block and a
    policy naming one class. (Derandomized: the shrinker can also stop at the
    equally small SizeBasedWrap at a block's numel.)"""
    got = find(model_cases(TOY, apis=st.just("fsdp1")), lambda c: any(u.mixed and u.path for u in predict_fsdp1(c).units),
               settings=settings(database=None, max_examples=2000, derandomize=True))
    assert got.frozen == ("blocks.0.ln.weight",)
    assert got.plan.policy == ModuleWrap(("conformance.models.toy_target.Block",))  # classes by qualified name


def test_presets_come_from_the_target():
    """"Train only what matches" the target's trainable_patterns, and BitFit,
    are among the freeze masks drawn."""
    from conformance.case.target import base_graph
    from conformance.strategies.targets import model_freeze_masks as freeze_masks

    params = [f for f, _ in base_graph(TOY).named_parameters()]
    only_block1 = tuple(f for f in params if not f.startswith("blocks.1."))
    bitfit = tuple(f for f in params if not f.endswith(".bias"))
    for want in (only_block1, bitfit):
        find(freeze_masks(TOY, ("patterns", "bitfit")), lambda m, want=want: m == want,
             settings=settings(database=None, max_examples=500))


# ---- the oracle on a target -----------------------------------------------------------


def test_fsdp1_prediction_on_the_toy_target():
    case = ModelCase(TOY, frozen=("blocks.0.ln.weight",), plan=WrapPlan("fsdp1", ModuleWrap(("Block",)), True))
    pred = predict_fsdp1(case)
    assert [u.path for u in pred.units] == ["blocks.0", "blocks.1", ""]
    assert [u.path for u in pred.warnings] == ["blocks.0"]
    assert pred.unit("").managed == ("embed.weight", "norm.weight", "norm.bias")
    assert [(t.fqn, t.aliases) for t in pred.ties] == [("embed.weight", ("embed.weight", "head.weight"))]
    assert "cache" not in " ".join(pred.state_dict_keys) and "scale" in pred.state_dict_keys


def test_fsdp2_prediction_for_an_opaque_generate():
    groups = (ShardGroup(("blocks.0",), True), ShardGroup(("blocks.1",), False), ShardGroup(("",), True))
    case = ModelCase(TOY, plan=WrapPlan("fsdp2", groups=groups), methods=(ForwardMethod("", "generate"),))
    pred = predict_fsdp2(case, "2.13.0")
    fwd, gen = pred.calls
    # after forward and after a registered generate: True groups sharded, the
    # root's as its flag says, a False group's state depends on the body
    assert fwd.sharded_after == gen.sharded_after == (True, None, True)
    assert gen.in_promise and gen.unshards == 1 and not gen.exact
    unregistered = ModelCase(TOY, plan=WrapPlan("fsdp2", groups=groups), methods=(ForwardMethod("", "generate", register=False),))
    assert not predict_fsdp2(unregistered, "2.13.0").calls[1].in_promise


def test_case_features_read_the_graph_of_a_target():
    from conformance.run.features import case_features

    case = ModelCase(TOY, frozen=("embed.weight",), plan=WrapPlan("fsdp2", groups=(ShardGroup(("blocks.0",)),)))
    # W=3: dim-0 16 and 8 are not divisible; the root's group holds the frozen embedding and the norm
    assert case_features(case, 3) == ["tie", "uneven shard", "mixed unit"]


# ---- invariants on a target turn red under injected faults ------------------------------


def _verdict(invariant, case, engine, scenario="fsdp1", parse=None):
    from conformance.areas.autowrap.observation import WrapObservation
    from conformance.areas.fully_shard.observation import FSDP2Observation
    from conformance.areas.parity.observation import TrainObservation

    parse = parse or {"fsdp1": WrapObservation.from_dict, "fsdp2": FSDP2Observation.from_dict, "train": TrainObservation.from_dict}.get(scenario.split(":")[-2] if scenario.startswith("model-fault") else scenario)
    return evaluate(invariant, case, observations(engine, case, scenario, parse))


def _fails(res, kind):
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


@pytest.mark.fake
def test_wrap_units_on_a_target_catches_a_dropped_target(fake_engine, monkeypatch):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    case = ModelCase(TOY, plan=WrapPlan("fsdp1", ModuleWrap(("Block",))))
    assert _verdict("WRAP-UNITS", case, fake_engine).verdict == PASS
    orig = ModuleWrapPolicy._run_policy

    def drop_last(self, *a, **k):
        targets = orig(self, *a, **k)
        targets.pop(list(targets)[-1])
        return targets

    monkeypatch.setattr(ModuleWrapPolicy, "_run_policy", drop_last)
    _fails(_verdict("WRAP-UNITS", case, fake_engine), "kind:missing-unit")


@pytest.mark.fake
def test_frozen_error_on_a_target_catches_a_skipped_check(fake_engine, monkeypatch):
    from torch.distributed.fsdp import _wrap_utils

    case = ModelCase(TOY, frozen=("blocks.1.attn.weight",), plan=WrapPlan("fsdp1", CustomWrap(("blocks.1",))))
    assert _verdict("FROZEN-ERROR", case, fake_engine).verdict == PASS
    monkeypatch.setattr(_wrap_utils, "_validate_frozen_params", lambda *a, **k: None)
    res = _verdict("FROZEN-ERROR", case, fake_engine)
    assert res.verdict == FAIL, res.describe()


@pytest.mark.fake
def test_fwd_reshard_on_a_target_catches_a_group_left_unsharded(fake_engine):
    from tests.self import faults_fsdp2 as faults

    groups = (ShardGroup(("blocks.0",), True), ShardGroup(("blocks.1",), True))
    case = ModelCase(TOY, plan=WrapPlan("fsdp2", groups=groups), methods=(ForwardMethod("", "generate"),))
    assert _verdict("FWD-RESHARD", case, fake_engine, "fsdp2").verdict in (PASS, KNOWN)
    with faults.FAULTS["never-reshard"]():
        res = _verdict("FWD-RESHARD", case, fake_engine, "fsdp2")
    _fails(res, "kind:not-resharded")


@pytest.mark.fake
def test_fwd_isolation_on_a_target(fake_engine):
    """FWD-ISOLATION on a ModelCase, which has no drawn tree (the same-class
    sibling check once read spec.tree and raised AttributeError here): its
    methods are all the root's, so an unregistered method has no registered
    sibling and is checked like any other call."""
    from conformance.areas.fully_shard.invariants import _registered_sibling

    groups = (ShardGroup(("blocks.0",), True), ShardGroup(("",), True))
    unregistered = ModelCase(TOY, plan=WrapPlan("fsdp2", groups=groups), methods=(ForwardMethod("", "generate", register=False),))
    assert _registered_sibling(unregistered, 0) is None
    res = _verdict("FWD-ISOLATION", unregistered, fake_engine, "fsdp2")
    assert res.verdict == UNCHECKED and res.unchecked == "no method is registered"
    registered = ModelCase(TOY, plan=WrapPlan("fsdp2", groups=groups), methods=(ForwardMethod("", "generate"),))
    assert _verdict("FWD-ISOLATION", registered, fake_engine, "fsdp2").verdict == PASS


@pytest.mark.fake
def test_fsdp2_groups_on_a_target_catches_a_lost_parameter(fake_engine):
    from tests.self import faults_fsdp2 as faults

    case = ModelCase(TOY, plan=WrapPlan("fsdp2", groups=(ShardGroup(("blocks.0",)),)))
    assert _verdict("FSDP2-GROUPS", case, fake_engine, "fsdp2").verdict == PASS
    with faults.FAULTS["managed-states-drop-last"]():
        res = _verdict("FSDP2-GROUPS", case, fake_engine, "fsdp2")
    assert res.verdict == FAIL, res.describe()


@pytest.mark.needs_ranks  # the session's gloo pool (the engine fixture, gloo tier only)
def test_parity_and_fwd_parity_on_a_target_catch_doubled_gradients(engine):
    """Values: in the ranks of a gloo pool (a test-only scenario applies the
    fault there). The target's loss, its generate and training all run."""
    import tests.self.model_faults  # noqa: F401  (registers the scenarios)

    gloo_engine = engine
    case = ModelCase(TOY, seed=1, frozen=("blocks.0.ln.weight",), plan=WrapPlan("fsdp2", groups=(ShardGroup(("blocks.0",), True),)),
                     methods=(ForwardMethod("", "generate"),), train=TrainPlan("SGD", 2))
    assert _verdict("PARITY", case, gloo_engine, "train").verdict == PASS
    assert _verdict("FWD-PARITY", case, gloo_engine, "fsdp2").verdict == PASS
    _fails(_verdict("PARITY", case, gloo_engine, "model-fault:train:gradients-doubled"), "kind:param")
    _fails(_verdict("FWD-PARITY", case, gloo_engine, "model-fault:fsdp2:gradients-doubled"), "kind:grad")


# ---- a target written outside the suite: CLI, API, pytest plugin, bad input ----------------


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("user_project")
    (d / "tinylm.py").write_text(textwrap.dedent(SOURCE))
    return d


def _env(user_dir: Path, with_user_dir: bool = True) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(([str(user_dir)] if with_user_dir else []) + [str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_cli_runs_a_user_target(user_dir):
    rep = user_dir / "cli-report"
    cli = Path(sys.executable).with_name("fsdp-conformance")  # the console script: cwd is not on its sys.path
    proc = subprocess.run(
        [str(cli) if cli.exists() else sys.executable, *([] if cli.exists() else ["-m", "conformance.cli"]), "model", "tinylm:target", "--tiers", "fake,gloo", "--examples", "2",
         "--invariant", "WRAP-UNITS", "--invariant", "FWD-PARITY", "--report-dir", str(rep)],
        cwd=user_dir, env=_env(user_dir, with_user_dir=False), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((rep / "report.json").read_text())
    rows = {(r["invariant"], r["tier"]): r for r in report["results"]}
    sys.path.insert(0, str(user_dir))
    try:  # the natural configurations run first, then the 2 drawn
        from conformance.strategies.targets import natural_model_cases

        natural = len(natural_model_cases("tinylm:target", ("fsdp1",)))
    finally:
        sys.path.remove(str(user_dir))
    assert natural >= 4  # each wrap class as two policies, either use_orig_params
    for tier in ("fake", "gloo"):  # the gloo ranks import the user's module too
        assert rows[("WRAP-UNITS", tier)]["examples"] == natural + 2 and rows[("WRAP-UNITS", tier)]["verdict"] == "PASS"
    # FWD-PARITY compares values: on the fake tier the examples ran and compared none (SKIP)
    assert rows[("FWD-PARITY", "fake")]["verdict"] == "SKIP" and "values are not compared" in rows[("FWD-PARITY", "fake")]["reason"]
    # (a drawn model case may call no registered method: that one compares nothing)
    assert rows[("FWD-PARITY", "gloo")]["checked"] >= 1 and rows[("FWD-PARITY", "gloo")]["verdict"] in ("PASS", "KNOWN")
    assert report["run"]["target"] == "tinylm:target"


def test_python_api_runs_a_user_target(user_dir, monkeypatch, fake_engine):
    import conformance

    monkeypatch.syspath_prepend(str(user_dir))
    from conformance.strategies.targets import natural_model_cases

    run = conformance.check_model("tinylm:target", invariants=["FSDP2-GROUPS", "FROZEN-WARN"], examples=2,
                                  tiers=("fake",), engines={"fake": fake_engine})
    assert run.ok, run.summary()
    assert {(i, t) for i, t in run.checked} == {("FSDP2-GROUPS", "fake"), ("FROZEN-WARN", "fake")}
    # each: the target's natural configurations of its API, then 2 drawn
    natural = len(natural_model_cases("tinylm:target", ("fsdp1",))) + len(natural_model_cases("tinylm:target", ("fsdp2",)))
    assert sum(t.examples for t in run.session.tallies.values()) == natural + 4


def test_pytest_plugin_runs_a_user_target(user_dir):
    (user_dir / "test_user_model.py").write_text(textwrap.dedent('''
        import pytest

        @pytest.mark.fsdp_model("tinylm:target", invariants=["WRAP-FQNS", "FWD-RESHARD"], examples=1)
        def test_fsdp(fsdp_model):
            run = fsdp_model.check()
            assert run.ok and len(run.checked) == 2

        def test_fsdp_bad_target(fsdp_model):
            fsdp_model.check("tinylm:bad_class")

        @pytest.mark.fsdp_model("tinylm:target", invariants=["NO-SUCH-INVARIANT"])
        def test_fsdp_bad_invariant(fsdp_model):
            fsdp_model.check()
    '''))
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "test_user_model.py"]
    if "fsdp_conformance" not in {e.name for e in importlib.metadata.entry_points(group="pytest11")}:
        args[3:3] = ["-p", "conformance.plugin"]  # not installed through the entry point (yet)
    proc = subprocess.run(args, cwd=user_dir, env=_env(user_dir), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert "1 passed" in out and "2 failed" in out, out
    assert "target 'tinylm:bad_class': wrap class 'DecoderLayer' is not a class of any module of the model" in out, out
    # an unknown invariant: one line, no traceback
    assert "fsdp_model: unknown invariant ID 'NO-SUCH-INVARIANT'" in out, out
    assert "Traceback" not in out and "UnknownInvariant" not in out, out


BAD = [
    ("nosuchpkg.model:target", "cannot import 'nosuchpkg.model'"),
    ("tinylm:bad_factory", "factory(0) raised RuntimeError: out of coffee"),
    ("tinylm:no_params", "the model has no parameters"),
    ("tinylm:bad_inputs", "the model rejects its inputs"),
    ("tinylm:missing_method", "the model has no method 'beam_search'"),
    ("tinylm:bad_class", "wrap class 'DecoderLayer' is not a class of any module of the model"),
]


def _children() -> set[int]:
    """Live child processes of this process (rank pools would be ours)."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                out.add(int(d.name))
    return out


@pytest.mark.parametrize("ref,why", BAD, ids=[b[0].split(":")[-1] for b in BAD])
def test_bad_target_is_one_line_and_exit_2(user_dir, monkeypatch, capsys, ref, why):
    from conformance.cli import main

    monkeypatch.syspath_prepend(str(user_dir))
    before = _children()
    rc = main(["model", ref, "--backend", "gloo", "--report-dir", str(user_dir / "bad")])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"target {ref!r}" in lines[0] and why in lines[0], err
    assert "Traceback" not in err
    assert _children() <= before  # no rank process left behind (the early pool: closed)


# ---- defaults that compare values; output a person can act on ------------------------

NOISY = "tests.self.noisy_target:target"


@pytest.mark.needs_ranks
def test_noisy_method_is_fail_on_the_default_tier(tmp_path):
    """check_model's default tier compares values: a registered method that
    adds random noise is FAIL there, with its message, case and repro; on
    the fake tier FWD-PARITY compares nothing (SKIP, never PASS)."""
    from conformance.run.models import DEFAULT_TIERS, check_model

    assert DEFAULT_TIERS == ("gloo",)
    run = check_model(NOISY, invariants=["FWD-PARITY"], examples=1, seed=0, repro_dir=tmp_path)
    assert [(f["invariant"], f["tier"]) for f in run.failures] == [("FWD-PARITY", "gloo")], run.summary()
    assert not any(f.known_failure for t in run.session.tallies.values() for f in t.findings.values())  # FAIL, not KNOWN
    out = run.summary()
    assert "FAIL FWD-PARITY/gloo: [FWD-PARITY] call 1 (method 0) output differs from the reference's" in out, out
    assert f"ModelCase(target={NOISY!r}" in out
    repro = run.failures[0]["repro"]
    assert repro and Path(repro).is_file() and f"  repro: {repro}" in out
    fake = check_model(NOISY, invariants=["FWD-PARITY"], tiers=("fake",), examples=1, seed=0)
    assert fake.ok and all(t.examples == t.verdicts.get("UNCHECKED", 0) > 0 for t in fake.session.tallies.values())
    assert "SKIP" in fake.summary() and " PASS " not in fake.summary()


def test_marker_default_tier_is_check_models():
    from conformance.plugin.models import DEFAULT_TIERS as MARKER_TIERS
    from conformance.run.models import DEFAULT_TIERS

    assert MARKER_TIERS == DEFAULT_TIERS


@pytest.mark.needs_ranks
def test_cli_model_failure_prints_message_case_and_repro(tmp_path, capsys):
    from conformance.cli import main

    rc = main(["model", NOISY, "--backend", "gloo", "--invariant", "FWD-PARITY", "--examples", "1", "--seed", "0",
               "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1
    line = next(x for x in out.splitlines() if x.startswith("FAIL FWD-PARITY/gloo: "))
    assert "output differs from the reference's" in line
    assert "case (paste into Python):" in out and f"ModelCase(target={NOISY!r}" in out
    repro = next(x.split("repro: ", 1)[1] for x in out.splitlines() if x.strip().startswith("repro: "))
    assert Path(repro).is_file() and Path(repro).parent == tmp_path / "repros"


def _one_line_exit_2(capsys, args, want):
    from conformance.cli import main

    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and want in lines[0] and "Traceback" not in err, err


def test_cli_model_nccl_without_gpus_is_one_line_and_exit_2(capsys, tmp_path):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per rank: nccl is available")
    _one_line_exit_2(capsys, ["model", TOY, "--backend", "nccl", "--report-dir", str(tmp_path)], "backend 'nccl'")


def test_cli_model_rejects_an_unknown_profile(capsys, tmp_path):
    _one_line_exit_2(capsys, ["model", TOY, "--profile", "bogus", "--examples", "3", "--report-dir", str(tmp_path)],
                     "unknown Hypothesis profile 'bogus'")


@pytest.mark.needs_ranks
def test_a_lifecycle_model_case_repro_replays_it_on_real_ranks(tmp_path):
    """A model's checkpoint case: its repro replays the case through `check`
    on gloo (the model repro rebuilds wrapping and training only) and runs
    from a directory of its own."""
    from conformance.run.repro import repro_script
    from conformance.strategies.targets import natural_model_cases

    case = natural_model_cases(TOY, ("fsdp2",), "roundtrip")[0]
    script = tmp_path / "repro.py"
    script.write_text(repro_script(case, ["[OPTIM-STATE] a line"], "OPTIM-STATE"))
    text = script.read_text()
    assert '"BACKEND", "gloo"' in text and case.to_json() in text
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env={**_env(tmp_path, with_user_dir=False), "TMPDIR": str(scratch)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OPTIM-STATE: PASS" in proc.stdout, proc.stdout + proc.stderr
    assert list(scratch.iterdir()) == []  # the case file it checks went with its run


# ---- the lifecycle on a model: validation, SKIP reasons -------------------------------


def test_model_case_lifecycle_is_validated():
    from conformance.case.spec import CheckpointPlan, Microbatch, Schedule, ScheduleStep
    from conformance.case.target import TargetError, check_case

    with pytest.raises(SpecError, match="no microbatch skips"):
        ModelCase(TOY, schedule=Schedule((ScheduleStep(microbatches=(Microbatch(("blocks.0",)),)),)))
    with pytest.raises(SpecError, match="first microbatch is a forward"):
        ModelCase(TOY, schedule=Schedule(first=0))
    with pytest.raises(SpecError, match="world sizes"):
        ModelCase(TOY, ckpt=CheckpointPlan(save_world=4))
    with pytest.raises(TargetError, match="head.weight"):  # the tied head's second name, not its canonical FQN
        check_case(ModelCase(TOY, plan=WrapPlan("fsdp2"), ckpt=CheckpointPlan(refreeze=("head.weight",))))
    with pytest.raises(TargetError, match="NoSuchClass"):
        check_case(ModelCase(TOY, ckpt=CheckpointPlan(load_plan=WrapPlan("fsdp1", ModuleWrap(("NoSuchClass",))))))
    check_case(ModelCase(TOY, plan=WrapPlan("fsdp2"), ckpt=CheckpointPlan(refreeze=("embed.weight",), load_frozen=("blocks.0.ln.weight",))))


def test_an_invariant_a_model_cannot_have_is_skip_with_its_areas_reason(tmp_path):
    """Not a hard-coded exclusion: the reason is the area record's
    (Area.model_cases), or the tier's; the report's rows say it."""
    from conformance.areas import area_of
    from conformance.cli import main

    rc = main(["model", TOY, "--backend", "fake", "--invariant", "FWD-SUMMON", "--invariant", "SD-FULL", "--invariant", "RANKS-AGREE",
               "--examples", "1", "--report-dir", str(tmp_path)])
    assert rc == 0
    rows = {r["invariant"]: r for r in json.loads((tmp_path / "report.json").read_text())["results"] if r["tier"] == "fake"}
    assert area_of("FWD-SUMMON").model_cases and area_of("FWD-SUMMON").model_cases in rows["FWD-SUMMON"]["reason"]
    assert not area_of("SD-FULL").model_cases and "fake tier" in rows["SD-FULL"]["reason"]
    assert "nothing to disagree with" in rows["RANKS-AGREE"]["reason"]
    assert all(rows[i]["verdict"] == "SKIP" and rows[i]["checked"] == 0 for i in ("FWD-SUMMON", "SD-FULL", "RANKS-AGREE"))


@pytest.mark.fake
def test_an_api_this_torch_lacks_is_skip_not_failure(monkeypatch, fake_engine):
    """check_model outside pytest: the session's SKIP for an API the
    installed torch cannot run becomes a SKIP row with the reason."""
    from conformance.areas.common import support
    from conformance.run.models import check_model

    monkeypatch.setattr(support, "unavailable", lambda api, scenario, tier: "no FSDP2 here" if api == "fsdp2" else None)
    run = check_model(TOY, invariants=["FSDP2-GROUPS", "WRAP-UNITS"], tiers=("fake",), examples=1, seed=0, engines={"fake": fake_engine})
    assert run.ok, run.summary()
    assert run.skipped == [{"invariant": "FSDP2-GROUPS", "tier": "fake", "reason": "no FSDP2 here"}]
    assert run.checked == [("WRAP-UNITS", "fake")]
