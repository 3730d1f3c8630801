"""AC-PARITY, AC-STATE-DICT and AC-ALLGATHER catch faults injected into
activation checkpointing and its composition with FSDP.

Each test shows the hand-written case holds on unmodified torch, then
injects one plausible regression (of torch.utils.checkpoint,
checkpoint_wrapper, or FSDP's hooks in the recomputed forward) inside the
ranks of a gloo pool (through the test-only scenarios of
tests/self/faults_activation_checkpointing.py) and shows the invariant turns
it into a FAIL of the expected kind.
"""

from __future__ import annotations

import pytest

from conformance.areas.activation_checkpointing.observation import ACObservation
from conformance.case.spec import (
    ActivationCheckpointPlan,
    CaseSpec,
    ClassSpec,
    CustomWrap,
    ModuleSpec,
    ParamSpec,
    ShardGroup,
    TiedParam,
    WrapPlan,
)
from conformance.run.runner import FAIL, KNOWN, PASS, evaluate, observations
from tests.self import faults_activation_checkpointing  # noqa: F401  (registers the fault scenarios in the driver)

pytestmark = pytest.mark.selfcheck

AC = ("AC-PARITY", "AC-STATE-DICT", "AC-ALLGATHER", "AC-RECOMPUTE")


def model(plan: WrapPlan, ac: ActivationCheckpointPlan, *, frozen: bool = False, tie: bool = False, tail: bool = False) -> CaseSpec:
    """root (scale) -> outer (u) -> block (w, inner (v)) and head (h);
    ``tail``: outer.tail (s) after block, so that checkpointing outer
    recomputes block before block's own backward; ``frozen``: inner.v frozen; ``tie``: inner.t is block.w (one FSDP2 group, one FSDP1 unit)."""
    inner = ModuleSpec("inner", "Inner", (ParamSpec("v", (4, 3), not frozen),))
    block = ModuleSpec("block", "Block", (ParamSpec("w", (3,)),), children=(inner,))
    rest = (ModuleSpec("tail", "Head", (ParamSpec("s", (3,)),)),) if tail else ()
    outer = ModuleSpec("outer", "Outer", (ParamSpec("u", (2, 2)),), children=(block, *rest))
    head = ModuleSpec("head", "Head", (ParamSpec("h", (5,)),))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(outer, head))
    ties = (TiedParam("outer.block.inner", "t", "outer.block.w"),) if tie else ()
    classes = tuple(ClassSpec(c) for c in ("Model", "Outer", "Block", "Inner", "Head"))
    return CaseSpec(tree=tree, classes=classes, ties=ties, plan=plan, activation_checkpoint=ac, seed=3)


def frozen_in_region(plan: WrapPlan) -> CaseSpec:
    """root -> outer (checkpoint_wrapper, non-reentrant) -> embed0, embed1
    (Embeddings: nothing to differentiate through them) and proj (Linear,
    after them), every parameter frozen (the gradient flows to the input
    alone): the recompute of outer re-runs embed0's forward in backward, the
    only reader of its parameters there (FSDP2's backward prefetch from the
    root reaches embed1, the last group, not embed0). Seed 2601's case,
    reduced."""
    outer = ModuleSpec("outer", "Outer", children=(
        ModuleSpec("embed0", "Embedding", (ParamSpec("weight", (3, 2), False),)),
        ModuleSpec("embed1", "Embedding", (ParamSpec("weight", (2, 2), False),)),
        ModuleSpec("proj", "Linear", (ParamSpec("weight", (2, 2), False),)),
    ))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,), False),), children=(outer,))
    classes = tuple(ClassSpec(c) for c in ("Model", "Outer"))
    return CaseSpec(tree=tree, classes=classes, plan=plan, activation_checkpoint=ActivationCheckpointPlan("wrapper-non-reentrant", ("outer",), steps=2), seed=5)


FSDP2 = WrapPlan(api="fsdp2", groups=(ShardGroup(("outer.block",)), ShardGroup(("head",))))
FSDP1 = WrapPlan(api="fsdp1", policy=CustomWrap(("outer.block", "head")))
FSDP1_UOP = WrapPlan(api="fsdp1", policy=CustomWrap(("outer.block", "head")), use_orig_params=True)

CASES = {
    # AC around a group: the recompute runs the group's forward in backward
    "fsdp2-around-nonreentrant": lambda: model(FSDP2, ActivationCheckpointPlan("wrapper-non-reentrant", ("outer",)), tail=True),
    "fsdp2-around-utils": lambda: model(FSDP2, ActivationCheckpointPlan("utils-checkpoint", ("outer",), steps=2)),
    # AC on the group's own module, and inside it
    "fsdp2-is-unit-reentrant": lambda: model(FSDP2, ActivationCheckpointPlan("wrapper-reentrant", ("outer.block",))),
    "fsdp2-inside-selective-frozen": lambda: model(FSDP2, ActivationCheckpointPlan("selective", ("outer.block.inner",)), frozen=True),
    "fsdp2-composable-tie": lambda: model(FSDP2, ActivationCheckpointPlan("composable", ("outer", "head")), tie=True, tail=True),
    "fsdp1-around-nonreentrant": lambda: model(FSDP1, ActivationCheckpointPlan("wrapper-non-reentrant", ("outer",))),
    "fsdp1-inside-reentrant-uop": lambda: model(FSDP1_UOP, ActivationCheckpointPlan("wrapper-reentrant", ("outer.block.inner",))),
    "fsdp1-is-unit-utils": lambda: model(FSDP1, ActivationCheckpointPlan("utils-checkpoint", ("outer.block", "head"), steps=2)),
    # a frozen unit in the region, with no backward of its own: the recompute gathers it
    "fsdp2-frozen-group-in-region": lambda: frozen_in_region(WrapPlan(api="fsdp2", groups=(ShardGroup(("outer.embed0",)), ShardGroup(("outer.embed1",))))),
    "fsdp1-frozen-unit-in-region": lambda: frozen_in_region(WrapPlan(api="fsdp1", policy=CustomWrap(("outer.embed0",)), use_orig_params=True)),
}

FAULTS = [
    ("AC-PARITY", "fsdp2-around-utils", "checkpoint-detaches-region", "kind:param"),
    ("AC-PARITY", "fsdp1-around-nonreentrant", "checkpoint-detaches-region", "kind:param"),
    ("AC-PARITY", "fsdp2-inside-selective-frozen", "fsdp2-frozen-get-zero-grads", "kind:frozen-grad"),
    ("AC-STATE-DICT", "fsdp2-around-nonreentrant", "wrapper-keeps-prefix", "kind:wrapper-prefix"),
    # FSDP1's own state-dict hook then misses the parameter under the unstripped name and asserts
    ("AC-STATE-DICT", "fsdp1-inside-reentrant-uop", "wrapper-keeps-prefix", "kind:state-dict-raised"),
    ("AC-ALLGATHER", "fsdp2-around-nonreentrant", "fsdp2-reshard-after-recompute", "kind:extra-gathers"),
    ("AC-ALLGATHER", "fsdp2-composable-tie", "fsdp2-reshard-after-recompute", "kind:extra-gathers"),
    ("AC-ALLGATHER", "fsdp1-is-unit-utils", "fsdp1-regather-in-backward", "kind:extra-gathers"),
    ("AC-ALLGATHER", "fsdp2-frozen-group-in-region", "fsdp2-recompute-gathers-twice", "kind:extra-gathers"),
    ("AC-RECOMPUTE", "fsdp2-around-nonreentrant", "checkpoint-keeps-activations", "kind:not-recomputed"),
    ("AC-RECOMPUTE", "fsdp1-inside-reentrant-uop", "checkpoint-keeps-activations", "kind:not-recomputed"),
    ("AC-RECOMPUTE", "fsdp1-is-unit-utils", "checkpoint-keeps-activations", "kind:not-recomputed"),
    ("AC-RECOMPUTE", "fsdp1-inside-reentrant-uop", "checkpoint-recomputes-twice", "kind:extra-recompute"),
    ("AC-RECOMPUTE", "fsdp2-is-unit-reentrant", "checkpoint-recomputes-twice", "kind:extra-recompute"),
    ("AC-RECOMPUTE", "fsdp2-around-nonreentrant", "checkpoint-probes-region-in-forward", "kind:forward-calls"),
    ("AC-RECOMPUTE", "fsdp1-inside-reentrant-uop", "checkpoint-probes-region-in-forward", "kind:forward-calls"),
]


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(2)


def run(invariant: str, spec: CaseSpec, engine, scenario: str = "activation-checkpointing"):
    return evaluate(invariant, spec, observations(engine, spec, scenario, ACObservation.from_dict))


@pytest.mark.gloo
@pytest.mark.parametrize("case", sorted(CASES))
def test_cases_hold_on_unmodified_torch(case, pool):
    spec = CASES[case]()
    obs = observations(pool, spec, "activation-checkpointing", ACObservation.from_dict)
    for invariant in AC:
        res = evaluate(invariant, spec, obs)
        assert res.verdict == PASS, res.describe()


@pytest.mark.gloo
@pytest.mark.parametrize("invariant,case,fault,kind", FAULTS, ids=[f"{f[0]}-{f[1]}-{f[2]}" for f in FAULTS])
def test_fault_is_caught_inside_the_ranks(invariant, case, fault, kind, pool):
    res = run(invariant, CASES[case](), pool, f"fault:ac:{fault}")
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


def test_the_oracle_tags_where_ac_sits():
    from conformance.areas.activation_checkpointing.oracle import predict_ac

    assert "ac:around-unit" in predict_ac(CASES["fsdp2-around-utils"]()).tags
    assert "ac:is-unit" in predict_ac(CASES["fsdp2-is-unit-reentrant"]()).tags
    assert {"ac:inside-unit", "ac:frozen-inside", "frozen"} <= predict_ac(CASES["fsdp2-inside-selective-frozen"]()).tags
    assert "tie" in predict_ac(CASES["fsdp2-composable-tie"]()).tags
    for case, units in (("fsdp2-frozen-group-in-region", {"outer.embed0", "outer.embed1"}), ("fsdp1-frozen-unit-in-region", {"outer.embed0"})):
        pred = predict_ac(CASES[case]())
        assert "ac:frozen-unit-in-region" in pred.tags and pred.frozen_in_region == units, case
    assert not predict_ac(CASES["fsdp2-around-nonreentrant"]()).frozen_in_region


@pytest.mark.gloo
@pytest.mark.parametrize("case", ["fsdp2-frozen-group-in-region", "fsdp1-frozen-unit-in-region"])
def test_the_recompute_of_a_frozen_unit_is_the_only_backward_gather(case, pool):
    """The frozen unit's forward runs again in backward (AC-RECOMPUTE's
    count) and is gathered for it, which the unit structure alone (0 in
    backward) does not imply: the allowance is used, not idle."""
    spec = CASES[case]()
    obs = observations(pool, spec, "activation-checkpointing", ACObservation.from_dict)
    back = {(s, g): n for s, ph, g, n in obs[0].gathers if ph == "backward"}
    plain = {(s, g): n for s, ph, g, n in obs[0].plain_gathers if ph == "backward"}
    for step in (0, 1):
        assert back.get((step, "outer.embed0"), 0) == 1 and plain.get((step, "outer.embed0"), 0) == 0, (obs[0].gathers, obs[0].plain_gathers)


@pytest.mark.gloo
def test_fsdp1_nested_units_recompute_gathers_are_counted_per_unit(pool):
    """AC around nested FSDP1 units (outer and outer.block, a reentrant
    checkpoint_wrapper on outer): the recompute re-gathers each of them once
    more in backward (fsdp1-ac-around-unit-regathers), and AC-ALLGATHER names
    both units, not only a per-phase total; head, outside the region, is
    gathered as the unit structure implies."""
    plan = WrapPlan(api="fsdp1", policy=CustomWrap(("outer", "outer.block", "head")))
    spec = model(plan, ActivationCheckpointPlan("wrapper-reentrant", ("outer",)))
    res = run("AC-ALLGATHER", spec, pool)
    assert res.verdict == KNOWN and {f for _, f in res.known} == {"fsdp1-ac-around-unit-regathers"}, res.describe()
    extra = {v.message.split(":")[0] for v, _ in res.known if "kind:extra-gathers" in v.tags}
    assert extra == {"step 0 backward unit outer", "step 0 backward unit outer.block",
                     "step 1 backward unit outer", "step 1 backward unit outer.block"}, res.describe()


def test_a_wrapper_unit_below_a_tie_is_tagged_for_its_finding():
    """FSDP1's size policy never wraps a ModuleDict but may wrap the
    CheckpointWrapper around one: with a parameter of the ModuleDict tied to
    the root, that unit is below the tie's users' common ancestor, the case
    fsdp1-tie-below-lca-not-rejected records (thorough, seed 1); without the
    tie, or with another policy, it is not."""
    from conformance.areas.activation_checkpointing.oracle import predict_ac
    from conformance.case.spec import SizeBasedWrap

    def case(tie: bool, policy) -> CaseSpec:
        tree = ModuleSpec("", "Model", children=(ModuleSpec("blocks", "BlockDict", (ParamSpec("weight", (2, 2)),)),))
        return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("BlockDict", "ModuleDict")), seed=1,
                        ties=(TiedParam("", "tied0", "blocks.weight"),) if tie else (), plan=WrapPlan(api="fsdp1", policy=policy),
                        activation_checkpoint=ActivationCheckpointPlan("wrapper-non-reentrant", ("blocks",)))

    assert "outside:tie-below-lca" in predict_ac(case(True, SizeBasedWrap(1))).tags
    assert "outside:tie-below-lca" not in predict_ac(case(False, SizeBasedWrap(1))).tags
    assert "outside:tie-below-lca" not in predict_ac(case(True, CustomWrap(()))).tags


def two_reentrant_regions() -> CaseSpec:
    """Seed 15's case: one FSDP1 unit (the root) holding two reentrant
    regions, model0 then model1. model1's nested backward flushes the
    root's flat parameter (its post-backward frees it); model0's recompute
    then reads model0.weight, a view of the freed storage: unguarded, the
    kernel reads freed memory (garbage values, or a segfault that killed an
    xdist worker in the in-process fake tier)."""
    tree = ModuleSpec("", "Model", children=(
        ModuleSpec("model0", "Model", (ParamSpec("weight", (1, 1)), ParamSpec("bias", (1,)))),
        ModuleSpec("model1", "Model", (ParamSpec("weight", (1, 1)),))))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"),), plan=WrapPlan(api="fsdp1", use_orig_params=False),
                    activation_checkpoint=ActivationCheckpointPlan(kind="wrapper-reentrant", targets=("model0", "model1")))


@pytest.mark.parametrize("tier", ["fake", "gloo"])
def test_a_read_of_freed_storage_is_an_error_not_a_crash(tier, pool):
    """The adapter's guard turns the read of a parameter FSDP already freed
    into an error on every tier, before the kernel runs; the error is the
    known finding's own form (error:freed-storage)."""
    from conformance.engine.fake import FakeEngine
    from conformance.run import known

    spec = two_reentrant_regions()
    if tier == "fake":
        with FakeEngine(2) as fake:
            obs = observations(fake, spec, "activation-checkpointing", ACObservation.from_dict)
    else:
        obs = observations(pool, spec, "activation-checkpointing", ACObservation.from_dict)
    assert any("model0.weight read in forward with its storage freed" in (o.step_error or "") for o in obs), [o.step_error for o in obs]
    res = evaluate("AC-PARITY", spec, obs, known.load())
    assert res.verdict == KNOWN and res.known[0][1] == "fsdp1-reentrant-checkpoint-frees-unit-early", res.describe()
    assert any("error:freed-storage" in v.tags for v, _ in res.known)


@pytest.mark.gloo
def test_a_read_of_the_trained_values_that_raises_is_fsdps_not_the_scenarios(pool):
    """FSDP1's summon_full_params raising when the area reads the trained
    values: the observation says so (the model trained without AC fails
    the same read, so the failure is FSDP's, not checkpointing's: AC-PARITY
    compares nothing and says why), not the scenario's own error."""
    res = run("AC-PARITY", CASES["fsdp1-around-nonreentrant"](), pool, "fault:ac:fsdp1-summon-raises")
    assert res.verdict == "UNCHECKED" and "full values" in res.unchecked and "without AC" in res.unchecked, res.describe()
