"""INIT-ORDER, INIT-META, INIT-SYNC and INIT-DIVERGENT catch faults
injected into FSDP's initialisation paths.

Each test shows the hand-written case holds on unmodified torch, then
injects one plausible regression inside the ranks of a gloo pool (through
the test-only scenarios of tests/self/faults_init_order.py) and shows the
invariant turns it into a FAIL of the expected kind. The rank-divergent
cases show a hang reported as one, well before the pool's deadline.
"""

from __future__ import annotations

import time

import pytest

from conformance.areas.init_order.observation import InitObservation
from conformance.case.spec import (
    BufferSpec,
    CaseSpec,
    ClassSpec,
    CustomWrap,
    InitPlan,
    ModuleSpec,
    ParamSpec,
    ShardGroup,
    TiedParam,
    WrapPlan,
)
from conformance.run import known
from conformance.run.runner import FAIL, KNOWN, PASS, evaluate, observations
from tests.self import faults_init_order  # noqa: F401  (registers the fault scenarios in the driver)

pytestmark = pytest.mark.selfcheck

IDS = ("INIT-ORDER", "INIT-META", "INIT-SYNC", "INIT-DIVERGENT")


def model(plan: WrapPlan, init: InitPlan) -> CaseSpec:
    """root (scale) -> block (w, a buffer; proj: Linear 3x3) and head
    (Linear 1x3: an empty FSDP2 shard on rank 1 of 2, an uneven one of block.proj's 3 rows)."""
    block = ModuleSpec("block", "Block", (ParamSpec("w", (3,)),), buffers=(BufferSpec("running", (2,)),), children=(
        ModuleSpec("proj", "Linear", (ParamSpec("weight", (3, 3)), ParamSpec("bias", (3,)))),
    ))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(block, ModuleSpec("head", "Linear", (ParamSpec("weight", (1, 3)),))))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), plan=plan, init=init, seed=5)


FSDP2 = WrapPlan(api="fsdp2", groups=(ShardGroup(("block",)),))
FSDP1 = WrapPlan(api="fsdp1", policy=CustomWrap(("block",)), use_orig_params=True)
FSDP1_FLAT = WrapPlan(api="fsdp1", policy=CustomWrap(("block",)))

CASES = {
    "fsdp2-actions": lambda: model(FSDP2, InitPlan(before=("state_dict", "unshard", "get_model_state_dict", "unshard-async"), optimizer="Adam")),
    "fsdp2-state-dicts": lambda: model(FSDP2, InitPlan(before=("state_dict", "get_model_state_dict"))),
    "fsdp2-optim-after": lambda: model(FSDP2, InitPlan(before=("unshard",), optimizer_after_forward=True)),
    "fsdp2-float64": lambda: model(FSDP2, InitPlan(before=("state_dict",), dtype="float64", optimizer="AdamW")),
    "fsdp2-meta": lambda: model(FSDP2, InitPlan(meta=True)),
    "fsdp2-sync": lambda: model(FSDP2, InitPlan(sync=True)),
    # scale (the root's own) registered anew, then an unshard: lazy init after the replacement
    "fsdp2-replace": lambda: model(FSDP2, InitPlan(replace=True, before=("unshard",), optimizer="Adam")),
    "fsdp2-meta-replace": lambda: model(FSDP2, InitPlan(meta=True, replace=True)),
    "fsdp1-actions": lambda: model(FSDP1, InitPlan(before=("get_model_state_dict", "state_dict"), optimizer_after_forward=True)),
    "fsdp1-meta": lambda: model(FSDP1_FLAT, InitPlan(meta=True, optimizer="Adam")),
    "fsdp1-divergent-partly-used": lambda: model(FSDP1, InitPlan(skip="head")),
}

# (invariant, case, fault, the violation kind)
FAULTS = [
    ("INIT-ORDER", "fsdp2-state-dicts", "lazy-init-replaces-sharded-params", "kind:loss"),
    ("INIT-ORDER", "fsdp2-float64", "reset-sharded-param-noop", "kind:raised"),
    ("INIT-ORDER", "fsdp2-meta", "reset-sharded-param-noop", "kind:loss"),
    # the mutant fsdp2-lazy-init-skips-reset-sharded-param: the replaced scale is never all-gathered
    ("INIT-ORDER", "fsdp2-replace", "lazy-init-skips-reset", "kind:loss"),
    ("INIT-ORDER", "fsdp2-meta-replace", "lazy-init-skips-reset", "kind:loss"),
    ("INIT-META", "fsdp1-meta", "fsdp1-param-init-fn-not-called", "kind:meta-value"),
    # the buffer of block, a unit: named block._fsdp_wrapped_module.running by named_buffers()
    ("INIT-META", "fsdp1-meta", "fsdp1-materialize-loses-buffers", "kind:meta-value"),
    ("INIT-SYNC", "fsdp2-sync", "dcp-broadcast-skipped", "kind:not-synced"),
    ("INIT-DIVERGENT", "fsdp1-divergent-partly-used", "fsdp1-reduce-scatter-not-reduced", "kind:param"),
    # reading the materialised model's full values raises: the observation says so (at:init), not the scenario
    ("INIT-META", "fsdp1-meta", "fsdp1-summon-raises", "at:init"),
]

HOLDS = {  # the invariants each case compares something for
    "fsdp2-actions": ("INIT-ORDER",), "fsdp2-state-dicts": ("INIT-ORDER",), "fsdp2-optim-after": ("INIT-ORDER",), "fsdp2-float64": ("INIT-ORDER",),
    "fsdp2-meta": ("INIT-ORDER", "INIT-META"), "fsdp2-sync": ("INIT-ORDER", "INIT-SYNC"), "fsdp2-replace": ("INIT-ORDER",),
    "fsdp2-meta-replace": ("INIT-ORDER", "INIT-META"), "fsdp1-actions": ("INIT-ORDER",),
    "fsdp1-meta": ("INIT-ORDER", "INIT-META"), "fsdp1-divergent-partly-used": ("INIT-DIVERGENT",),
}


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(2)


def run(invariant: str, spec: CaseSpec, engine, scenario: str = "init_order", known_failures=None):
    return evaluate(invariant, spec, observations(engine, spec, scenario, InitObservation.from_dict), known_failures)


@pytest.mark.gloo
@pytest.mark.parametrize("case", sorted(CASES))
def test_cases_hold_on_unmodified_torch(case, pool):
    spec = CASES[case]()
    obs = observations(pool, spec, "init_order", InitObservation.from_dict)
    for invariant in IDS:
        res = evaluate(invariant, spec, obs, [])
        want = PASS if invariant in HOLDS[case] else "UNCHECKED"
        assert res.verdict == want, res.describe()


@pytest.mark.gloo
@pytest.mark.parametrize("invariant,case,fault,kind", FAULTS, ids=[f"{f[0]}-{f[1]}-{f[2]}" for f in FAULTS])
def test_fault_is_caught_inside_the_ranks(invariant, case, fault, kind, pool):
    res = run(invariant, CASES[case](), pool, f"fault:init:{fault}", [])
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


@pytest.mark.gloo
def test_fsdp1_sync_reaches_the_buffers_of_the_modules_under_a_unit(pool):
    """FSDP1's sync_module_states broadcasts each unit's buffers with
    module.buffers(): those of head (under the root unit) and block.proj
    (under block's) too. On CPU the sync raises (finding
    fsdp1-sync-module-states-rejects-cpu); with that check off, as on a GPU,
    it runs over gloo and INIT-SYNC holds. Each rank seeds a buffer pair on
    every module; a sync of each unit's own buffers only leaves those below
    it as each rank built them, and INIT-SYNC names them."""
    spec = model(FSDP1, InitPlan(sync=True))
    assert run("INIT-SYNC", spec, pool, known_failures=[]).verdict == FAIL  # the recorded finding, unmodified
    res = run("INIT-SYNC", spec, pool, "fault:init:fsdp1-sync-allowed-on-cpu", [])
    assert res.verdict == PASS, res.describe()
    res = run("INIT-SYNC", spec, pool, "fault:init:fsdp1-sync-own-buffers-only", [])
    assert res.verdict == FAIL, res.describe()
    text = res.describe()
    assert all("kind:not-synced" in v.tags for v in res.violations), text
    for name in ("head.init_persistent", "block.proj.init_persistent", "block.proj.init_non_persistent"):
        assert name in text, text
    for name in ("scale", "block.w", "block.running", "block.init_persistent"):  # the units' own: synced
        assert f"{name} " not in text and f"{name}:" not in text, text


@pytest.mark.gloo
@pytest.mark.parametrize("api,plan", [("fsdp2", FSDP2), ("fsdp1", FSDP1)])
def test_a_module_one_rank_skips_in_a_group_of_its_own_is_a_hang_not_a_blocked_run(api, plan, pool):
    """block is its own group (unit); rank 1 never calls it: its all-gather
    is never issued there. FSDP runs on a group of the example's own with a
    short timeout, so INIT-DIVERGENT reports a hang well before the pool's
    deadline, and the recorded finding makes it KNOWN."""
    spec = model(plan, InitPlan(skip="block"))
    t0 = time.monotonic()
    obs = observations(pool, spec, "init_order", InitObservation.from_dict)  # one hang, judged twice
    assert time.monotonic() - t0 < pool.deadline / 2
    res = evaluate("INIT-DIVERGENT", spec, obs, [])
    assert res.verdict == FAIL and any("kind:hang" in v.tags and "skip:own-group" in v.tags for v in res.violations), res.describe()
    again = evaluate("INIT-DIVERGENT", spec, obs, known.load())
    assert again.verdict == KNOWN, again.describe()
    assert {fid for _, fid in again.known} == {f"{api}-rank-divergent-{'module-collective-mismatch' if api == 'fsdp2' else 'unit-hangs'}"}


def test_a_rank_divergent_case_predicts_where_the_skipped_parameters_sit():
    from conformance.areas.init_order.oracle import predict_init

    assert "skip:own-group" in predict_init(model(FSDP2, InitPlan(skip="block"))).tags
    assert "skip:group-partly-used" in predict_init(model(FSDP2, InitPlan(skip="head"))).tags
    assert "skip:group-partly-used" in predict_init(model(FSDP1, InitPlan(skip="block.proj"))).tags


def test_init_specs_draw_what_each_api_supports():
    from hypothesis import given, settings
    from hypothesis.errors import InvalidArgument

    from conformance.strategies.init_order import init_specs

    @settings(max_examples=25, deadline=None, database=None)
    @given(spec=init_specs(api="fsdp1"))
    def fsdp1(spec):
        p = spec.init
        assert p.dtype is None and not any(a.startswith("unshard") for a in p.before) and p.skip is None
        assert spec.plan.use_orig_params or not p.optimizer_after_forward
        assert not (p.meta and p.sync)

    @settings(max_examples=15, deadline=None, database=None)
    @given(spec=init_specs(api="fsdp2", kind="divergent"))
    def divergent(spec):
        p = spec.init
        assert p.skip and not (p.meta or p.sync or p.before or p.dtype) and not spec.ties and not spec.shared

    fsdp1()
    divergent()
    for bad in (dict(api="fsdp3"), dict(kind="other")):
        with pytest.raises(InvalidArgument):
            init_specs(**bad)


@pytest.mark.gloo
def test_a_tie_meta_init_breaks_is_seen_even_where_the_copies_train_alike(pool):
    """Seed 2024: FSDP1 meta-device init of a root weight tied into a child
    that uses it the same way. The broken tie's two copies get the same
    gradient, so their values stay equal and comparing values after training
    cannot see the break; the flat parameters' element count can (INIT-META
    kind:untied, then matched to fsdp1-meta-init-unties with INIT-ORDER's
    trajectory)."""
    tree = ModuleSpec("", "Model", (ParamSpec("weight", (8, 2)),), children=(ModuleSpec("model0", "Model"),))
    spec = CaseSpec(tree=tree, classes=(ClassSpec("Model"),), ties=(TiedParam("model0", "tied0", "weight"),),
                    plan=WrapPlan(api="fsdp1"), init=InitPlan(meta=True, steps=2))
    res = run("INIT-META", spec, pool, known_failures=[])
    assert res.verdict == FAIL and any("kind:untied" in v.tags for v in res.violations), res.describe()
    again = run("INIT-ORDER", spec, pool, known_failures=known.load())
    assert again.verdict == KNOWN, again.describe()


@pytest.mark.gloo
def test_a_wrap_that_raises_on_one_rank_is_a_disagreement_not_a_hang(pool):
    """FSDP1's constructor raising on rank 1 only (seed 32 of the autowrap
    area: a size policy meeting rank 1's shard of a tied Parameter wrapped a
    child twice there) must not leave rank 0 in the adapter's structure
    check: the ranks' disagreement is RANKS-AGREE, well before the deadline
    (it was a HANG after 60 s)."""
    from conformance.areas.autowrap.observation import WrapObservation
    from tests.self import cases

    spec = cases.two_blocks()
    t0 = time.monotonic()
    obs = observations(pool, spec, "fault:autowrap:rank1-wrap-raises", WrapObservation.from_dict)
    assert time.monotonic() - t0 < pool.deadline / 2
    by_rank = {o.rank: o for o in obs}
    assert by_rank[1].error is not None and "injected" in by_rank[1].error.text, by_rank[1]
    assert by_rank[0].error is None and by_rank[0].state_dict_error == "skipped: the ranks built different FSDP units", by_rank[0]
    res = evaluate("RANKS-AGREE", spec, obs, [])
    assert res.verdict == FAIL and any("kind:ranks" in v.tags for v in res.violations), res.describe()


def test_trained_values_are_judged_within_the_reference_noise():
    """INIT-ORDER judges the trained values as PARITY, TP-PARITY and HSDP
    do: within the training tolerance, and where a value is not, within
    NOISE_FACTOR times the float32 reference's own distance from float64 on
    top (a LayerNorm over one element: a noise gradient that Adam turns into
    a step, ci seed 11530 in TP-PARITY). The float64 reference runs only
    when some value is off; an O(1) error is caught whatever the floor."""
    import torch

    from conformance.areas.common.training import NOISE_FACTOR
    from conformance.areas.init_order.adapter import _checks

    want = {"w": torch.tensor([0.5, -0.25]), "norm.weight": torch.tensor([-0.4311])}
    calls = []

    def floor():
        calls.append(1)
        return {"norm.weight": torch.tensor([1e-3]), "w": torch.zeros(2)}

    def judged(got: dict, floor=floor):
        return {c.name: c.equal for c in _checks(list(got.items()), want, "param", exact=False, floor=floor)}

    assert judged(dict(want)) == {"w": True, "norm.weight": True} and not calls  # all close: no float64 run
    noisy = {"w": want["w"], "norm.weight": want["norm.weight"] + 0.5 * NOISE_FACTOR * 1e-3}
    assert judged(noisy, floor=None)["norm.weight"] is False  # beyond the tolerance alone
    assert judged(noisy) == {"w": True, "norm.weight": True} and calls == [1]
    assert judged({"w": want["w"] * 2, "norm.weight": want["norm.weight"]})["w"] is False  # a sum for a mean
    assert judged({"w": want["w"], "norm.weight": want["norm.weight"] + 2 * NOISE_FACTOR * 1e-3})["norm.weight"] is False


@pytest.mark.gloo
@pytest.mark.parametrize("case", ["fsdp2-actions", "fsdp2-meta"])
def test_lazy_init_without_its_reset_passes_where_no_parameter_was_registered_anew(case, pool):
    """The fault lazy-init-skips-reset is caught through InitPlan.replace
    alone: without a replaced parameter (the same actions; meta init, whose
    to_empty goes through FSDPModule._apply) it changes nothing."""
    res = run("INIT-ORDER", CASES[case](), pool, "fault:init:lazy-init-skips-reset", [])
    assert res.verdict == PASS, res.describe()
