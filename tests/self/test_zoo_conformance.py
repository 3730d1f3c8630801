"""CI's zoo budget: every invariant on each zoo model, green on the
installed torch with the recorded findings KNOWN: the fake tier's
structural invariants (the natural configurations, then two drawn plans
each), and on the gloo pool the training lifecycle (full and sharded state
dicts, DCP save and resume across plans and world sizes, optimizer state
across freeze changes, mixed precision, accumulation) on each target's
natural configurations and one drawn case. `fsdp-conformance model TARGET`
runs the same with any budget."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the zoo needs the zoo extra (pip install -e '.[zoo]')")
pytest.importorskip("peft", reason="the zoo needs the zoo extra (pip install -e '.[zoo]')")

from conformance import check_model  # noqa: E402
from conformance.case.spec import ModuleWrap, TransformerWrap  # noqa: E402
from conformance.run.session import Session  # noqa: E402
from conformance.strategies.targets import natural_model_cases  # noqa: E402

pytestmark = [pytest.mark.selfcheck]

ZOO = [
    "gpt2",
    "llama_lora",  # PEFT's lora.Linear shares torch's class name: classes go by qualified name
    "t5",
    "bert",
]
LIFECYCLE = ["SD-FULL", "TIES-KEPT", "CKPT-RESHARD", "OPTIM-STATE", "MP-DTYPES", "ACCUM"]
LLAMA = "conformance.models.zoo.llama_lora:target"
DECODER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"


def _rows(run) -> dict:
    out: dict = {}
    for t in run.session.tallies.values():
        row = out.setdefault((t.invariant, t.tier), {"examples": 0, "checked": 0, "verdicts": set()})
        row["examples"] += t.examples
        row["checked"] += t.examples - t.verdicts.get("UNCHECKED", 0)
        row["verdicts"].add(t.verdict)
    return out


@pytest.mark.fake
@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_holds_every_applicable_invariant(name):
    run = check_model(f"conformance.models.zoo.{name}:target", tiers=("fake",), examples=2, seed=0)
    assert run.checked, f"no invariant ran on {name}"
    assert run.ok, run.summary()
    # the lifecycle compares values and world sizes: SKIP on the fake tier, with the reason
    skipped = {s["invariant"]: s["reason"] for s in run.skipped}
    assert set(LIFECYCLE) <= set(skipped) and all("fake tier" in skipped[i] for i in LIFECYCLE)


@pytest.mark.gloo
@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_through_the_lifecycle(name, worlds):
    """Every lifecycle invariant runs on the target (none silently left
    out) and compares values on at least one example, its natural
    configurations among them. One pool, and one pool per other world
    size, serve every model (as a run's session pools do)."""
    ref = f"conformance.models.zoo.{name}:target"
    run = check_model(ref, invariants=LIFECYCLE, examples=1, seed=0, engines={"gloo": worlds})
    assert run.ok, run.summary()
    assert not run.skipped, run.skipped
    rows = _rows(run)
    for inv in LIFECYCLE:
        row = rows.get((inv, "gloo"))
        assert row is not None and row["checked"] >= 1, (inv, row, run.summary())
    lifecycle_naturals = len(natural_model_cases(ref, lifecycle="roundtrip"))
    assert lifecycle_naturals >= 2  # FSDP1 and FSDP2 plans of its wrap class
    assert rows[("OPTIM-STATE", "gloo")]["examples"] >= lifecycle_naturals + 1


class RecordingSession(Session):
    """A session that remembers every case it checked."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.cases: list = []

    def check_example(self, invariants, spec, engine, tier):
        self.cases.append(spec)
        return super().check_example(invariants, spec, engine, tier)


def test_natural_configurations_of_a_lora_model():
    """Each wrap class as ModuleWrapPolicy and as a transformer policy, with
    each trainable pattern and either use_orig_params; FSDP2 with every
    decoder layer fully_shard-ed and generate registered."""
    cases = natural_model_cases(LLAMA)
    lora_only = next(c.frozen for c in cases)
    assert not any("lora_" in f for f in lora_only) and any("lora_" not in f for f in lora_only)
    fsdp1 = {(type(c.plan.policy), c.plan.use_orig_params, c.frozen) for c in cases if c.plan.api == "fsdp1"}
    assert {(ModuleWrap, False, lora_only), (ModuleWrap, True, lora_only), (TransformerWrap, False, lora_only), (TransformerWrap, True, lora_only)} <= fsdp1
    assert all(c.plan.policy.classes == (DECODER,) for c in cases if c.plan.api == "fsdp1")
    fsdp2 = [c for c in cases if c.plan.api == "fsdp2"]
    assert fsdp2 and all([g.modules for g in c.plan.groups] == [("base_model.model.model.layers.0",), ("base_model.model.model.layers.1",)] for c in fsdp2)
    assert all([(m.name, m.register) for m in c.methods] == [("generate", True)] for c in fsdp2)
    assert len({c.frozen for c in fsdp2}) == 2  # each trainable pattern


@pytest.mark.fake
def test_a_budget_of_three_reaches_the_lora_frozen_error_and_warning():
    """The natural configurations run first whatever the budget: with 3
    drawn examples, LoRA under ModuleWrapPolicy(LlamaDecoderLayer) is
    checked with use_orig_params=False (FROZEN-ERROR: the decoder layer
    mixes frozen base weights and trainable adapters) and True (FROZEN-WARN)."""
    session = RecordingSession()
    run = check_model(LLAMA, invariants=["FROZEN-ERROR", "FROZEN-WARN"], tiers=("fake",), examples=3, seed=0, session=session)
    assert run.ok, run.summary()
    lora_only = natural_model_cases(LLAMA)[0].frozen
    seen = {(c.plan.use_orig_params, c.plan.policy) for c in session.cases if c.frozen == lora_only}
    assert (False, ModuleWrap((DECODER,))) in seen and (True, ModuleWrap((DECODER,))) in seen
    rows = _rows(run)
    natural = len(natural_model_cases(LLAMA, ("fsdp1",)))
    for inv in ("FROZEN-ERROR", "FROZEN-WARN"):
        assert rows[(inv, "fake")]["examples"] == natural + 3
    # the oracle predicts the error and the warning there, and FSDP1 gives them (checked, not skipped)
    from conformance.areas.common.fsdp1_oracle import predict_fsdp1
    from conformance.case.model_case import ModelCase
    from conformance.case.spec import WrapPlan

    err = predict_fsdp1(ModelCase(LLAMA, frozen=lora_only, plan=WrapPlan("fsdp1", ModuleWrap((DECODER,)), False)))
    warn = predict_fsdp1(ModelCase(LLAMA, frozen=lora_only, plan=WrapPlan("fsdp1", ModuleWrap((DECODER,)), True)))
    assert err.error is not None and "layers.0" in err.error.path
    assert any("layers.0" in w.path for w in warn.warnings)


@pytest.fixture(scope="module")
def pool():
    from conformance.engine.pool import RankPool
    from conformance.engine.scenarios import default_preload

    p = RankPool(2, "gloo", deadline=120.0, preload=(*default_preload(), "tests.self.faults_checkpoint", "tests.self.faults_training"))
    p.tier = "gloo"
    yield p
    p.close()


@pytest.fixture(scope="module")
def worlds(pool):
    from conformance.engine.worlds import Worlds

    w = Worlds(pool)
    yield w
    w.close()


def _lora(lifecycle, api="fsdp2"):
    """The natural LoRA case of ``api`` (FSDP1: ModuleWrapPolicy(LlamaDecoderLayer),
    use_orig_params=True) with that lifecycle, only the adapters trainable."""
    lora_only = natural_model_cases(LLAMA)[0].frozen
    return next(c for c in natural_model_cases(LLAMA, (api,), lifecycle) if c.frozen == lora_only)


LORA_FAULTS = [
    # (invariant, lifecycle, API, scenario, phases, kind)
    ("SD-FULL", "full", "fsdp2", "fault:ckpt-full:full-sd-perturbed", None, "kind:values"),
    ("CKPT-RESHARD", "roundtrip", "fsdp2", "ckpt-roundtrip", ("ckpt-save", "fault:ckpt-load:load-skips-model"), "kind:model"),
    ("OPTIM-STATE", "roundtrip", "fsdp2", "ckpt-roundtrip", ("ckpt-save", "fault:ckpt-load:optim-state-dropped"), "kind:lost-at-load"),
    ("CKPT-RESHARD", "roundtrip", "fsdp1", "ckpt-roundtrip", ("ckpt-save", "fault:ckpt-load:load-skips-model"), "kind:model"),
    ("ACCUM", "schedule", "fsdp2", "fault:schedule:fsdp2-sync-ignored", None, "kind:reduced-unsynced"),
    ("ACCUM", "schedule", "fsdp1", "fault:schedule:fsdp1-no-sync-ignored", None, "kind:reduced-unsynced"),
    ("MP-DTYPES", "schedule", "fsdp2", "fault:schedule:fsdp2-param-dtype-ignored", None, "kind:compute-dtype"),
]


@pytest.mark.gloo
@pytest.mark.parametrize("invariant,lifecycle,api,scenario,phases,kind", LORA_FAULTS, ids=[f"{f[0]}-{f[2]}" for f in LORA_FAULTS])
def test_a_lora_fine_tune_catches_a_lifecycle_fault(invariant, lifecycle, api, scenario, phases, kind, pool):
    """The LoRA fine-tune (FSDP2 with every decoder layer sharded, or FSDP1
    with each decoder layer a unit; only the adapters train) holds each
    lifecycle invariant on unmodified torch, and turns FAIL of the expected
    kind when one regression is applied inside the ranks
    (tests/self/faults_checkpoint.py, faults_training.py)."""
    import tests.self.faults_checkpoint  # noqa: F401  (the driver checks scenario names too)
    import tests.self.faults_training  # noqa: F401
    from conformance.areas import scenario_of
    from conformance.engine.worlds import Worlds
    from conformance.run.runner import FAIL, PASS, evaluate, observations

    case = _lora(lifecycle, api)
    parse = scenario_of(invariant).observation.from_dict
    engine = Worlds(pool) if lifecycle != "schedule" else pool
    res = evaluate(invariant, case, observations(engine, case, scenario_of(invariant).name, parse))
    assert res.verdict == PASS, res.describe()
    engine = Worlds(pool, phases={"ckpt-roundtrip": phases}) if lifecycle != "schedule" else pool
    res = evaluate(invariant, case, observations(engine, case, scenario, parse))
    assert res.verdict == FAIL and any(kind in v.tags for v in res.violations), res.describe()


@pytest.mark.parametrize("uop, error", [(False, "setStorage"), (True, "'weight' must be 2-D")])
def test_the_t5_split_shows_as_its_finding_with_the_crash(tmp_path, uop, error, cli_in_process):
    """FSDP1 ModuleWrapPolicy({T5Stack}) puts the shared embedding in the
    encoder unit, below its users' common ancestor, and accepts it
    (fsdp1-tie-below-lca-not-rejected): the oracle promises no training for
    such a case, but what training does is the finding's consequence, so
    `fsdp-conformance check` on the gloo pool reports PARITY as that finding
    with its crash, never PASS (issue: consequences are findings)."""
    from conformance.case.model_case import ModelCase
    from conformance.case.spec import TrainPlan, WrapPlan

    case = ModelCase("conformance.models.zoo.t5:target", 0, (),
                     WrapPlan("fsdp1", ModuleWrap(("transformers.models.t5.modeling_t5.T5Stack",)), uop), train=TrainPlan())
    path = tmp_path / "t5.json"
    path.write_text(case.to_json())
    # the CLI's main() in this process (cli_in_process): a subprocess would import torch and transformers again
    proc = cli_in_process("check", path, "--backend", "gloo", "--world-size", "2", "--invariant", "PARITY")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PARITY: KNOWN" in proc.stdout and "KNOWN fsdp1-tie-below-lca-not-rejected: [PARITY] training raised RuntimeError" in proc.stdout
    assert error in proc.stdout and "FSDP accepted it" in proc.stdout
