"""MP-DTYPES, MP-PIPELINE and ACCUM catch faults injected into FSDP's mixed precision and
gradient accumulation.

Each test shows the hand-written schedule holds on unmodified torch, then
injects one plausible regression inside the ranks of a gloo pool (through
the test-only scenarios of tests/self/faults_training.py) and shows the
invariant turns it into a FAIL of the expected kind.
"""

from __future__ import annotations

import dataclasses

import pytest

from conformance.areas.schedule.observation import MicrobatchSeen, ScheduleObservation
from conformance.case.spec import (
    BufferSpec,
    CaseSpec,
    ClassSpec,
    CustomWrap,
    Microbatch,
    ModuleSpec,
    ParamSpec,
    Precision,
    Schedule,
    ScheduleStep,
    ShardGroup,
    TiedParam,
    WrapPlan,
)
from conformance.run.runner import FAIL, KNOWN, PASS, evaluate, observations
from tests.self import faults_training  # noqa: E402,F401  (registers the fault scenarios in the driver)

pytestmark = pytest.mark.selfcheck

BF16_FP32 = Precision("bfloat16", "float32")


def model(plan: WrapPlan, schedule: Schedule, *, frozen_bias: bool = False, tie: bool = False) -> CaseSpec:
    """root (scale, a buffer) -> block (w, proj: Linear 3x3) and head
    (Linear 4x3, uneven over two ranks); ``tie``: block.t is block.w
    (a reused parameter, read twice by block's forward)."""
    block = ModuleSpec("block", "Block", (ParamSpec("w", (3,)),), children=(
        ModuleSpec("proj", "Linear", (ParamSpec("weight", (3, 3)), ParamSpec("bias", (3,), not frozen_bias))),
    ))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), (BufferSpec("running", (3,)),), children=(
        block, ModuleSpec("head", "Linear", (ParamSpec("weight", (4, 3)),)),
    ))
    ties = (TiedParam("block", "t", "block.w"),) if tie else ()
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), ties=ties, plan=plan, schedule=schedule, seed=5)


def accumulate(k: int = 3, *, skip_first: tuple[str, ...] = ("head",), frozen: tuple[str, ...] = ()) -> tuple[ScheduleStep, ...]:
    mbs = (Microbatch(skip_first),) + (Microbatch(),) * (k - 1)
    return (ScheduleStep(frozen), ScheduleStep(frozen, mbs))


def synced(k: int = 2, *, skip_first: tuple[str, ...] = ("head",)) -> tuple[ScheduleStep, ...]:
    """As accumulate, gradient sync on in every microbatch (FSDP1 promises
    no dtype for gradients accumulated under no_sync)."""
    mbs = (Microbatch(skip_first),) + (Microbatch(),) * (k - 1)
    return (ScheduleStep(), ScheduleStep((), mbs, sync_every=True))


FSDP2 = WrapPlan(api="fsdp2", groups=(ShardGroup(("block",)),))
FSDP1 = WrapPlan(api="fsdp1", policy=CustomWrap(("block",)), use_orig_params=False)
FSDP1_UOP = WrapPlan(api="fsdp1", policy=CustomWrap(("block",)), use_orig_params=True)

CASES = {
    # no skips under reduce_dtype: see fsdp2-accumulated-grads-mixed-reduce-dtype
    "fsdp2-mp": lambda: model(FSDP2, Schedule(accumulate(2, skip_first=()), precision=BF16_FP32)),
    # a tie elsewhere: only the tied parameter's gradient gets the reuse slack
    "fsdp2-mp-tied": lambda: model(FSDP2, Schedule(accumulate(2, skip_first=()), precision=BF16_FP32), tie=True),
    "fsdp2-accum": lambda: model(FSDP2, Schedule(accumulate(3, frozen=("block.proj.bias",))), frozen_bias=True),
    "fsdp1-mp": lambda: model(FSDP1, Schedule(accumulate(2), precision=Precision("bfloat16", "float32", buffer_dtype="bfloat16"))),
    # MP-PIPELINE's FSDP1 cases: every step synced; original parameters and flat ones
    "fsdp1-mp-synced": lambda: model(FSDP1_UOP, Schedule(synced(2), precision=BF16_FP32)),
    "fsdp1-mp-bf16-reduce": lambda: model(FSDP1, Schedule(synced(2), precision=Precision("bfloat16"))),
    "fsdp1-accum": lambda: model(FSDP1_UOP, Schedule(accumulate(3, skip_first=()))),
    # a step that skips block.proj while block's unit runs: the FlatParameter
    # gives proj a zero gradient, and Adam steps it (the reference models it;
    # seed 22 found the unmodelled reference failing)
    "fsdp1-flat-unused": lambda: model(FSDP1, Schedule((ScheduleStep(), ScheduleStep((), (Microbatch(("block.proj",)),))), optimizer="Adam")),
    # the root's sharding strategy, which every unit inherits: NO_SHARD's flat
    # gradients are whole (MP-PIPELINE compares them unsharded), SHARD_GRAD_OP
    # keeps the parameters unsharded between forward and backward
    "fsdp1-no-shard": lambda: model(FSDP1, Schedule(synced(1), precision=BF16_FP32, sharding_strategy="NO_SHARD")),
    "fsdp1-zero2-accum": lambda: model(FSDP1_UOP, Schedule(accumulate(3, skip_first=()), sharding_strategy="SHARD_GRAD_OP")),
    "fsdp1-no-shard-accum": lambda: model(FSDP1_UOP, Schedule(accumulate(2, skip_first=()), sharding_strategy="NO_SHARD")),
    # no cast of the root's inputs promised: the test feeds float32 and casts
    # after FSDP's pre-forward, as a user does (MP-DTYPES kind:root-input-cast)
    "fsdp2-mp-no-cast": lambda: model(FSDP2, Schedule(accumulate(2, skip_first=()), precision=Precision("bfloat16", "float32", cast_forward_inputs=False))),
    "fsdp1-mp-no-root-cast": lambda: model(FSDP1, Schedule(synced(2), precision=Precision("bfloat16", "float32", cast_root_forward_inputs=False))),
}

FAULTS = [
    ("MP-DTYPES", "fsdp2-mp", "fsdp2-reduce-in-param-dtype", "kind:reduce-dtype"),
    ("MP-DTYPES", "fsdp2-mp", "fsdp2-param-dtype-ignored", "kind:compute-dtype"),
    ("MP-DTYPES", "fsdp2-mp", "gradients-doubled", "kind:grad"),
    ("MP-DTYPES", "fsdp1-mp", "fsdp1-buffers-not-cast", "kind:buffer-dtype"),
    ("MP-DTYPES", "fsdp1-mp", "fsdp1-grads-not-upcast", "kind:grad-dtype"),
    ("MP-PIPELINE", "fsdp2-mp", "fsdp2-unsynced-grads-accumulate-in-param-dtype", "kind:grad"),
    ("MP-PIPELINE", "fsdp2-mp", "fsdp2-reduce-in-param-dtype", "kind:grad"),
    ("MP-PIPELINE", "fsdp2-mp", "gradients-doubled", "kind:grad"),
    ("MP-PIPELINE", "fsdp2-mp", "fsdp2-grad-element-nan", "kind:grad"),
    ("MP-DTYPES", "fsdp2-mp", "fsdp2-grad-element-nan", "kind:grad"),
    ("ACCUM", "fsdp2-accum", "fsdp2-grad-element-nan", "kind:grad"),
    ("MP-PIPELINE", "fsdp2-accum", "fsdp2-unsynced-grads-dropped", "kind:grad"),
    ("MP-DTYPES", "fsdp1-mp-bf16-reduce", "fsdp1-reduce-dtype-ignored", "kind:reduce-dtype"),
    ("MP-PIPELINE", "fsdp1-mp-bf16-reduce", "fsdp1-reduce-dtype-ignored", "kind:grad"),
    ("MP-DTYPES", "fsdp1-mp-synced", "fsdp1-reduce-in-param-dtype", "kind:reduce-dtype"),
    ("MP-PIPELINE", "fsdp1-mp-synced", "fsdp1-reduce-in-param-dtype", "kind:grad"),
    ("MP-PIPELINE", "fsdp1-mp-synced", "fsdp1-reduced-grads-rounded-to-param-dtype", "kind:grad"),
    ("MP-PIPELINE", "fsdp1-mp", "fsdp1-reduced-grads-rounded-to-param-dtype", "kind:grad"),
    ("ACCUM", "fsdp2-accum", "fsdp2-sync-ignored", "kind:reduced-unsynced"),
    ("ACCUM", "fsdp2-accum", "fsdp2-unsynced-grads-dropped", "kind:grad"),
    ("ACCUM", "fsdp2-accum", "fsdp2-frozen-get-zero-grads", "kind:frozen-grad"),
    ("ACCUM", "fsdp1-accum", "fsdp1-no-sync-ignored", "kind:reduced-unsynced"),
    ("ACCUM", "fsdp1-zero2-accum", "fsdp1-no-sync-ignored", "kind:reduced-unsynced"),
    ("MP-PIPELINE", "fsdp1-no-shard", "fsdp1-no-shard-grad-not-all-reduced", "kind:grad"),
    ("ACCUM", "fsdp1-no-shard-accum", "fsdp1-no-shard-grad-not-all-reduced", "kind:grad"),
    ("MP-DTYPES", "fsdp2-mp-no-cast", "fsdp2-cast-forward-inputs-ignored", "kind:root-input-cast"),
    ("MP-DTYPES", "fsdp1-mp-no-root-cast", "fsdp1-cast-root-forward-inputs-ignored", "kind:root-input-cast"),
]


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(2)


def run(invariant: str, spec: CaseSpec, engine, scenario: str = "schedule"):
    return evaluate(invariant, spec, observations(engine, spec, scenario, ScheduleObservation.from_dict))


@pytest.mark.gloo
@pytest.mark.parametrize("case", sorted(CASES))
def test_cases_hold_on_unmodified_torch(case, pool):
    spec = CASES[case]()
    for invariant in ("MP-DTYPES", "ACCUM", "MP-PIPELINE"):
        res = run(invariant, spec, pool)
        assert res.verdict == PASS, res.describe()


# Regressions only MP-PIPELINE sees: every dtype as promised, the values
# within MP-DTYPES' dtype-aware tolerance of fp32 training, a rounding of
# the reduction (or accumulation) dtype away from the promised pipeline.
PIPELINE_ONLY = [
    ("fsdp2-mp", "fsdp2-unsynced-grads-accumulate-in-param-dtype"),
    ("fsdp2-mp", "fsdp2-accumulated-grad-rounded-to-param-dtype"),
    ("fsdp2-mp-tied", "fsdp2-accumulated-grad-rounded-to-param-dtype"),
    ("fsdp1-mp-synced", "fsdp1-reduced-grads-rounded-to-param-dtype"),
    ("fsdp1-mp", "fsdp1-reduced-grads-rounded-to-param-dtype"),
]


@pytest.mark.gloo
@pytest.mark.parametrize("case,fault", PIPELINE_ONLY, ids=[f[1] + "-" + f[0] for f in PIPELINE_ONLY])
def test_a_pipeline_only_fault_passes_mp_dtypes(case, fault, pool):
    spec = CASES[case]()
    obs = observations(pool, spec, f"fault:schedule:{fault}", ScheduleObservation.from_dict)
    assert evaluate("MP-DTYPES", spec, obs).verdict == PASS, evaluate("MP-DTYPES", spec, obs).describe()
    res = evaluate("MP-PIPELINE", spec, obs)
    assert res.verdict == FAIL and any("kind:grad" in v.tags for v in res.violations), res.describe()


@pytest.mark.gloo
def test_fsdp1_unsynced_steps_compare_losses_only(pool):
    """FSDP1 documents no dtype for gradients accumulated under no_sync:
    the gradients of a step with an unsynced microbatch are not compared
    with the emulated pipeline (its losses are), those of a synced step are."""
    spec = CASES["fsdp1-mp"]()  # step 0 synced, step 1 two microbatches, the first unsynced
    obs = observations(pool, spec, "schedule", ScheduleObservation.from_dict)
    for o in obs:
        assert all(mb.emulated_loss_err is not None for mb in o.microbatches)
        compared = {g.step for g in o.grads if g.emulated_err is not None}
        assert compared == {0}, o.grads


@pytest.mark.gloo
@pytest.mark.parametrize("invariant,case,fault,kind", FAULTS, ids=[f"{f[0]}-{f[2]}" for f in FAULTS])
def test_fault_is_caught_inside_the_ranks(invariant, case, fault, kind, pool):
    res = run(invariant, CASES[case](), pool, f"fault:schedule:{fault}")
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


@pytest.mark.gloo
def test_an_fsdp1_root_with_parameters_casting_under_cast_forward_inputs_is_its_finding(pool):
    """cast_forward_inputs=True, cast_root_forward_inputs=False: the root's
    setting takes precedence (the MixedPrecision note), yet FSDP1's pre-forward
    casts the inputs of a root that manages parameters
    (fsdp1-root-casts-inputs-despite-cast-root-false); a root whose parameters
    all lie in nested units gets them as fed, on unmodified torch."""
    pr = Precision("bfloat16", "float32", cast_forward_inputs=True, cast_root_forward_inputs=False)
    spec = model(FSDP1, Schedule(synced(2), precision=pr))  # the root manages scale
    res = run("MP-DTYPES", spec, pool)
    assert res.verdict == KNOWN and {fid for _, fid in res.known} == {"fsdp1-root-casts-inputs-despite-cast-root-false"}, res.describe()
    assert all("kind:root-input-cast" in v.tags for v, _ in res.known), res.describe()
    # the tag narrows the KNOWN to the finding's own cast (to param_dtype): another dtype stays a FAIL
    mbs = (MicrobatchSeen(0, 0, True, (), "float32", 0.0, fed=("float32",), handed=("float16",)),)
    obs = [ScheduleObservation(api="fsdp1", rank=r, world_size=2, backend="gloo", torch_version="2.13.0", rounding_noise=(0.0,),
                               microbatches=mbs) for r in range(2)]
    other = evaluate("MP-DTYPES", spec, obs)
    assert other.verdict == FAIL and all("cast:other" in v.tags for v in other.violations), other.describe()
    bare = dataclasses.replace(spec.tree, params=())  # every parameter in a nested unit: the root has no handle
    control = dataclasses.replace(spec, tree=bare, plan=WrapPlan(api="fsdp1", policy=CustomWrap(("block", "head"))))
    res = run("MP-DTYPES", control, pool)
    assert res.verdict == PASS, res.describe()


@pytest.mark.gloo
@pytest.mark.parametrize("fault,where", [("rank1-post-backward-raises", "step 0 microbatch 0"), ("rank1-optimizer-raises", "step 0 optimizer")])
def test_one_rank_failing_is_a_disagreement_not_a_hang(fault, where, pool):
    """A rank that raises leaves the example; the others must not wait for it
    in a collective of the suite's own (summon_full_params, all-gathers):
    the result is the ranks' disagreement, well before the pool's deadline."""
    spec = CASES["fsdp1-accum"]()
    obs = observations(pool, spec, f"fault:schedule:{fault}", ScheduleObservation.from_dict)
    by_rank = {o.rank: o for o in obs}
    assert by_rank[1].step_error.startswith(f"{where}: RuntimeError: injected"), by_rank[1]
    assert by_rank[0].step_error is None and by_rank[0].peer_failed == where, by_rank[0]
    res = evaluate("ACCUM", spec, obs)
    assert res.verdict == FAIL and any(v.invariant == "RANKS-AGREE" for v in res.violations), res.describe()


def _ill_conditioned_bf16() -> CaseSpec:
    from conformance.run import corpus

    return next(c.spec for c in corpus.load() if c.name == "suite-bf16-ill-conditioned-tolerance")


@pytest.mark.gloo
def test_an_ill_conditioned_bf16_case_is_judged_by_its_own_rounding_noise(pool):
    """Seed 66: SGD grows the weights of a chain of 1x1 layers until its
    activations cancel; in bfloat16 the loss of step 2 then lands 0.096 off
    fp32 training (fixed tolerance 0.08), and so does the same computation in
    bfloat16 without FSDP (0.10). The step's tolerance follows that noise."""
    from conformance.areas.schedule.oracle import NOISE_FACTOR, predict_schedule

    spec = _ill_conditioned_bf16()
    obs = observations(pool, spec, "schedule", ScheduleObservation.from_dict)
    assert obs[0].rounding_noise[2] * NOISE_FACTOR > predict_schedule(spec).tolerance  # the noise is what decides here
    for invariant in ("MP-DTYPES", "ACCUM"):
        res = evaluate(invariant, spec, obs)
        assert res.verdict == PASS, res.describe()
    # ... and a doubled gradient still stands far outside it
    res = run("MP-DTYPES", spec, pool, "fault:schedule:gradients-doubled")
    assert res.verdict == FAIL and any("kind:grad" in v.tags for v in res.violations), res.describe()


def test_the_step_tolerance_is_the_dtype_s_unless_rounding_alone_goes_further():
    from conformance.areas.schedule.oracle import NOISE_FACTOR, predict_schedule, step_tolerance

    pred = predict_schedule(_ill_conditioned_bf16())
    assert pred.tolerance == 8e-2
    assert step_tolerance(pred, 0.0) == step_tolerance(pred, 0.01) == 8e-2
    assert step_tolerance(pred, 0.1) == pytest.approx(NOISE_FACTOR * 0.1)


def test_a_torch_without_the_apis_is_a_skip_with_its_reason(monkeypatch):
    from conformance.areas.schedule import adapter as schedule

    assert schedule.missing_api() is None  # torch 2.13 has them all

    def missing():
        raise ImportError("cannot import name 'MixedPrecisionPolicy'")

    monkeypatch.setattr(schedule, "precision_api", missing)
    assert "MixedPrecisionPolicy" in schedule.missing_api()


@pytest.mark.gloo
@pytest.mark.parametrize("reduce", ["bfloat16", "float32", None])
@pytest.mark.parametrize("plan", [FSDP1, FSDP1_UOP], ids=["flat", "orig-params"])
def test_fsdp1_pipeline_is_bit_exact_at_two_ranks(plan, reduce, pool):
    """The measurement behind MP-PIPELINE's FSDP1 tolerance: an untied model
    at two ranks, param_dtype bf16 with each reduce_dtype, every step synced:
    FSDP1's losses and gradients equal the emulated pipeline's to the bit
    (its undocumented pre-division by 2 and post-division by 1 are exact)."""
    spec = model(plan, Schedule(synced(2), precision=Precision("bfloat16", reduce)))
    obs = observations(pool, spec, "schedule", ScheduleObservation.from_dict)
    errs = [mb.emulated_loss_err for o in obs for mb in o.microbatches] + [g.emulated_err for o in obs for g in o.grads if g.emulated_err is not None]
    assert len(errs) > 2 * len(obs) and all(e == 0.0 for e in errs), errs


def test_fsdp1_reuse_slack_covers_the_reused_parameters_only():
    """A tie widens MP-PIPELINE's FSDP1 tolerance for the tied parameter's
    gradient (and its unit's flat parameter, and the losses) only; the other
    gradients keep the fp32 slack (a reduction rounded once more is about
    1e-5 there, far outside it)."""
    from conformance.areas.schedule.oracle import PIPELINE_SLACK, pipeline_tolerance, predict_schedule
    from conformance.case.spec import TiedParam

    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(
        ModuleSpec("a", "Linear", (ParamSpec("weight", (3, 3)),)), ModuleSpec("b", "Linear", (ParamSpec("weight", (3, 3)),)),
        ModuleSpec("c", "Linear", (ParamSpec("weight", (3, 3)),))))
    spec = CaseSpec(tree=tree, classes=(ClassSpec("Model"),), ties=(TiedParam("b", "weight", "a.weight"),),
                    plan=WrapPlan(api="fsdp1", policy=CustomWrap(("c",))), schedule=Schedule(synced(1, skip_first=()), precision=BF16_FP32), seed=5)
    pred = predict_schedule(spec)
    assert pred.reused and pred.reused_params == ("a.weight",)
    for fqn in ("a.weight", "<flat parameter of the root>", None):
        assert pipeline_tolerance(pred, fqn) > 100 * PIPELINE_SLACK, fqn
    for fqn in ("scale", "c.weight", "<flat parameter of c>"):
        assert pipeline_tolerance(pred, fqn) == PIPELINE_SLACK, fqn


def test_the_reduction_slack_covers_every_order_and_no_more():
    """MP-PIPELINE beyond two ranks: the emulation sums the ranks' gradients
    in one order, FSDP's collective in another (no order is promised).
    Every order of four and of three bf16 contributions lands within
    reduction_slack of the emulation's, and the slack is a bf16 rounding
    of the contributions' magnitudes, not of the largest value: a small
    gradient gets a small slack (the flat 2 * world * eps * (1 + max) it
    replaced allowed 0.03 whatever the gradient)."""
    import itertools

    import torch

    from conformance.areas.schedule.oracle import EPS, reduction_slack

    gen = torch.Generator().manual_seed(0)
    for world in (3, 4):
        for scale in (1.0, 1e-3):
            have = [(scale * torch.randn(4096, generator=gen)).to(torch.bfloat16) for _ in range(world)]

            def mean(order):
                total = order[0]
                for t in order[1:]:
                    total = total + t
                return (total / world).float()

            emulated = mean(have)
            slack = reduction_slack(have, world, emulated, EPS["bfloat16"])
            spread = max(float(((mean(list(o)) - emulated).abs() - slack).max()) for o in itertools.permutations(have))
            assert spread <= 0.0, (world, scale, spread)
            assert float(slack.max()) < 0.1 * scale, (world, scale, float(slack.max()))
            assert float((mean(list(reversed(have))) - emulated).abs().max()) > 0.0  # the orders do differ
    two = [torch.randn(8, generator=gen).to(torch.bfloat16) for _ in range(2)]
    assert float(reduction_slack(two, 2, mean(two), EPS["bfloat16"]).abs().max()) == 0.0  # a + b = b + a


def test_the_reduction_slack_covers_a_subnormal_contributions_pre_division():
    """FSDP divides each rank's gradient by a power of two before the sum
    (pre-division 2 with two or four ranks, post-division 1 or 2): exact
    for normal numbers, not for a subnormal one, which rounds to its
    spacing. Thorough seed 71 (float16, two ranks): a 0.00837 and a
    -3.43e-05 gradient gave 0.0041656 where the mean rounded once is
    0.0041695, one ulp apart, and MP-PIPELINE failed. The slack covers
    FSDP's order on such elements, and only there: with normal
    contributions two ranks still get none."""
    import torch

    from conformance.areas.schedule.oracle import EPS, reduction_slack

    a, b = torch.tensor([0.00836944580078125], dtype=torch.float16), torch.tensor([-3.427267074584961e-05], dtype=torch.float16)
    emulated = ((a + b) / 2).float()
    fsdp = (a / 2 + b / 2).float()
    assert float(fsdp) != float(emulated)  # the seed's element: one ulp apart
    assert float((fsdp - emulated).abs()) <= float(reduction_slack([a, b], 2, emulated, EPS["float16"]))
    gen = torch.Generator().manual_seed(0)
    tiny = torch.finfo(torch.float16).tiny
    for world, pre, post in ((2, 2, 1), (4, 2, 2)):
        have = [(torch.randn(20000, generator=gen) * (tiny if r % 2 else 1e-2)).to(torch.float16) for r in range(world)]
        emulated = (sum(have[1:], have[0]) / world).float()
        fsdp = (sum((h / pre for h in have[1:]), have[0] / pre) / post).float()
        slack = reduction_slack(have, world, emulated, EPS["float16"])
        assert float(((fsdp - emulated).abs() - slack).max()) <= 0.0, world
        assert float((fsdp - emulated).abs().max()) > 0.0  # the pre-division did round somewhere
        assert float((slack - 4 * EPS["float16"] * emulated.abs() - world * tiny).max()) <= 0.0  # about one ulp of the mean, no more
    normal = [torch.randn(4096, generator=gen).clamp(min=0.1).to(torch.float16) for _ in range(2)]
    assert float(reduction_slack(normal, 2, ((normal[0] + normal[1]) / 2).float(), EPS["float16"]).abs().max()) == 0.0


@pytest.fixture(scope="module")
def pool4(fault_pools):
    return fault_pools(4)


@pytest.mark.gloo
@pytest.mark.parametrize("case", ["fsdp2-mp", "fsdp1-mp-bf16-reduce", "fsdp2-bf16-reduce"])
def test_four_ranks_hold_within_the_reduction_slack(case, pool4):
    """Four gloo ranks, which reduce in an order of their own: unmodified
    torch passes MP-PIPELINE, bf16 reductions included."""
    spec = CASES[case]() if case in CASES else model(FSDP2, Schedule(accumulate(2, skip_first=()), precision=Precision("bfloat16", "bfloat16")))
    res = run("MP-PIPELINE", spec, pool4)
    assert res.verdict == PASS, res.describe()


@pytest.mark.gloo
@pytest.mark.parametrize("case,fault", [("fsdp2-mp", "fsdp2-unsynced-grads-accumulate-in-param-dtype"),
                                        ("fsdp2-mp", "fsdp2-accumulated-grad-rounded-to-param-dtype"),
                                        ("fsdp1-mp-synced", "fsdp1-reduced-grads-rounded-to-param-dtype")])
def test_four_ranks_still_catch_a_bf16_rounding(case, fault, pool4):
    """The slack of an fp32 reduction over four ranks is a few fp32
    roundings: a gradient rounded once to bf16 is still outside it."""
    res = run("MP-PIPELINE", CASES[case](), pool4, f"fault:schedule:{fault}")
    assert res.verdict == FAIL and any("kind:grad" in v.tags for v in res.violations), res.describe()


@pytest.mark.gloo
def test_a_step_whose_promised_reduction_overflows_is_not_held_to_fp32(pool):
    """Seed 21: bf16 parameters, reduce_dtype float16, a model whose step-1
    reference gradients reach 2.2e6, past float16's 65504: the promised
    reduction is inf, FSDP's too. fp32 training is no bound there
    (overflow_steps); MP-PIPELINE, which reduces in float16 itself, still
    compares, and the step before is still held to fp32 training."""
    import json
    from pathlib import Path

    spec = CaseSpec.from_json(Path(__file__).with_name("data").joinpath("schedule-fp16-reduce-overflow.json").read_text())
    assert json.loads(spec.to_json())["case"]["schedule"]["precision"]["reduce_dtype"] == "float16"
    obs = observations(pool, spec, "schedule", ScheduleObservation.from_dict)
    assert all(o.overflow_steps == (1,) for o in obs), [o.overflow_steps for o in obs]
    assert any(g.step == 1 and g.err is not None and not g.err < 1e30 for o in obs for g in o.grads)  # inf (or nan) against fp32
    for invariant in ("MP-DTYPES", "ACCUM", "MP-PIPELINE"):
        res = evaluate(invariant, spec, obs)
        assert res.verdict == PASS, res.describe()
    doubled = observations(pool, spec, "fault:schedule:gradients-doubled", ScheduleObservation.from_dict)
    res = evaluate("MP-DTYPES", spec, doubled)
    assert res.verdict == FAIL and any("step 0" in v.message for v in res.violations), res.describe()


@pytest.mark.gloo
def test_a_read_of_the_trained_values_that_raises_is_a_parity_failure_not_a_scenario_error(pool):
    """FSDP1's summon_full_params raising when PARITY reads the trained
    values is the observation's step error (PARITY FAIL kind:raised), not
    the scenario's own error."""
    from conformance.areas.parity.observation import TrainObservation

    tree = ModuleSpec("", "Model", children=(ModuleSpec("a", "Linear", (ParamSpec("weight", (2, 2)),)),
                                             ModuleSpec("b", "Linear", (ParamSpec("weight", (2, 2)),))))
    spec = CaseSpec(tree=tree, classes=(ClassSpec("Model"),), plan=WrapPlan(api="fsdp1", use_orig_params=True), seed=3)
    res = evaluate("PARITY", spec, observations(pool, spec, "fault:train:fsdp1-summon-raises", TrainObservation.from_dict))
    assert res.verdict == FAIL and any("kind:raised" in v.tags and "full values" in v.message for v in res.violations), res.describe()


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_a_reused_parameter_accumulated_over_microbatches_gets_the_reuse_slack_per_microbatch(pool, name):
    """Thorough seed 16651: FSDP2, a Linear shared three ways, one step of
    three microbatches under no_sync. With reduce_dtype float16 the shared
    bias's gradient ended 8 units of float16 roundoff from the emulated
    pipeline's, beyond the reuse slack of one microbatch (4 units): each
    backward's reused gradient may round to another value (its three
    contributions summed in another order) and the no_sync accumulation
    carries each difference on. With two microbatches, every microbatch
    synced, or float32 reduction, the same case passed. The reuse slack is
    now per microbatch of the step, for reused parameters only. Rerun, the
    seed shrank to the bfloat16 form, 14 units off against 12: the
    microbatches' gradients cancel, and one rounding of theirs is large
    against the sum; the emulation now adds, element by element, a few
    roundings of the magnitudes each rank accumulates for a reused
    parameter. The gradients doubled still fail."""
    from pathlib import Path

    from conformance.areas.schedule.oracle import EPS, PIPELINE_SLACK, pipeline_tolerance, predict_schedule, reuse_slack
    from conformance.case.model_case import case_from_json

    spec = case_from_json((Path(__file__).parent / "data" / f"schedule_fsdp2_{name}_shared_module_three_microbatches.json").read_text())
    pred = predict_schedule(spec)
    assert pred.reduce_dtype == name
    assert reuse_slack(pred) == 4 * EPS[name] and "1.layer0.shared0.bias" in pred.reused_params
    assert pipeline_tolerance(pred, "1.layer0.shared0.bias", 3) == PIPELINE_SLACK + 3 * reuse_slack(pred)
    assert pipeline_tolerance(pred, "1.proj1.bias", 3) == pipeline_tolerance(pred, "1.proj1.bias", 1)  # not reused: as before
    assert pipeline_tolerance(pred, None) == PIPELINE_SLACK + reuse_slack(pred)  # a loss is one microbatch's
    res = run("MP-PIPELINE", spec, pool)
    assert res.verdict == PASS, res.describe()
    res = run("MP-PIPELINE", spec, pool, "fault:schedule:gradients-doubled")
    assert res.verdict == FAIL and any("kind:grad" in v.tags for v in res.violations), res.describe()
