"""CLIP-NORM and CLIP-GRADS catch faults injected into gradient clipping.

Each test shows the hand-written case holds on unmodified torch, then
injects one plausible regression of torch.nn.utils.clip_grad or of FSDP1's
clip_grad_norm_ inside the ranks of a gloo pool (through the test-only
scenarios of tests/self/faults_clip.py) and shows the invariant turns it
into a FAIL of the expected kind.
"""

from __future__ import annotations

import pytest

from conformance.areas.clip.observation import ClipObservation
from conformance.case.spec import (
    CLIP_PRECISIONS,
    CaseSpec,
    ClassSpec,
    ClipPlan,
    CustomWrap,
    ModuleSpec,
    ParamSpec,
    ShardGroup,
    TiedParam,
    WrapPlan,
)
from conformance.run.runner import FAIL, PASS, evaluate, observations
from tests.self import faults_clip  # noqa: F401  (registers the fault scenarios in the driver)

pytestmark = pytest.mark.selfcheck


def model(plan: WrapPlan, clip: ClipPlan, *, frozen_bias: bool = False, tie: bool = False) -> CaseSpec:
    """root (scale) -> block (w, proj: Linear 3x3) and head (Linear 1x3: an
    empty FSDP2 shard on rank 1 of 2); ``tie``: block.w2 is proj's bias."""
    block = ModuleSpec("block", "Block", (ParamSpec("w", (3,)),), children=(
        ModuleSpec("proj", "Linear", (ParamSpec("weight", (3, 3)), ParamSpec("bias", (3,), not frozen_bias))),
    ))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(block, ModuleSpec("head", "Linear", (ParamSpec("weight", (1, 3)),))))
    ties = (TiedParam("block", "w2", "block.proj.bias"),) if tie else ()
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), ties=ties, plan=plan, clip=clip, seed=5)


BF16, BF16_FP32, BF16_KEEP = CLIP_PRECISIONS
FSDP2 = WrapPlan(api="fsdp2", groups=(ShardGroup(("block",)),))
FSDP1 = WrapPlan(api="fsdp1", policy=CustomWrap(("block",)))
FSDP1_UOP = WrapPlan(api="fsdp1", policy=CustomWrap(("block",)), use_orig_params=True)
FSDP1_IGNORED = WrapPlan(api="fsdp1", policy=CustomWrap(("block",)), ignored_modules=("head",))

CASES = {
    "fsdp2-l2": lambda: model(FSDP2, ClipPlan("2")),
    "fsdp2-l1-two-step": lambda: model(FSDP2, ClipPlan("1", "get_total_norm", foreach=False, fraction=0.1)),
    "fsdp2-subset": lambda: model(FSDP2, ClipPlan("3", subset="block")),
    "fsdp2-frozen-tie": lambda: model(FSDP2, ClipPlan("2"), frozen_bias=False, tie=True),
    "fsdp2-frozen": lambda: model(FSDP2, ClipPlan("inf", subset="block"), frozen_bias=True),
    "fsdp1-inf": lambda: model(FSDP1_UOP, ClipPlan("inf", "fsdp1-method")),
    "fsdp1-flat-unclipped": lambda: model(FSDP1, ClipPlan("2", "fsdp1-method", fraction=2.0)),
    "fsdp1-ignored": lambda: model(FSDP1_IGNORED, ClipPlan("1", "fsdp1-method")),
    # mixed precision: bf16 compute, reduced in bf16 / fp32; FSDP1's gradients kept in bf16
    "fsdp2-mp-bf16": lambda: model(FSDP2, ClipPlan("2", precision=BF16)),
    "fsdp2-mp-reduce-fp32": lambda: model(FSDP2, ClipPlan("1", "get_total_norm", fraction=0.1, precision=BF16_FP32)),
    "fsdp1-mp-uop": lambda: model(FSDP1_UOP, ClipPlan("2", "fsdp1-method", precision=BF16)),
    "fsdp1-mp-flat-keep-low": lambda: model(FSDP1, ClipPlan("inf", "fsdp1-method", fraction=2.0, precision=BF16_KEEP)),
}

FAULTS = [
    # the read of the stepped model's full values raises: CLIP-GRADS says so, not the scenario
    ("CLIP-GRADS", "fsdp1-inf", "fsdp1-summon-params-raises", "at:after-clip"),
    ("CLIP-NORM", "fsdp2-l2", "dtensor-norm-rank-local", "kind:norm"),
    ("CLIP-NORM", "fsdp2-subset", "dtensor-norm-rank-local", "kind:norm"),
    ("CLIP-NORM", "fsdp1-inf", "fsdp1-norm-not-all-reduced", "kind:norm"),
    ("CLIP-NORM", "fsdp1-ignored", "fsdp1-nonsharded-norm-counted-per-rank", "kind:norm"),
    ("CLIP-GRADS", "fsdp2-l2", "clip-coef-not-applied", "kind:grad"),
    ("CLIP-GRADS", "fsdp2-l1-two-step", "clip-coef-not-applied", "kind:grad"),
    ("CLIP-GRADS", "fsdp1-flat-unclipped", "fsdp1-clip-coef-not-clamped", "kind:grad"),
    ("CLIP-GRADS", "fsdp2-frozen", "fsdp2-frozen-get-zero-grads", "kind:frozen-grad"),
    # under mixed precision, against FSDP's own gradients gathered whole
    ("CLIP-NORM", "fsdp2-mp-bf16", "dtensor-norm-rank-local", "kind:norm"),
    ("CLIP-NORM", "fsdp1-mp-flat-keep-low", "fsdp1-norm-not-all-reduced", "kind:norm"),
    ("CLIP-NORM", "fsdp1-mp-uop", "fsdp1-norm-returned-in-bf16", "kind:dtype"),
    ("CLIP-GRADS", "fsdp2-mp-reduce-fp32", "clip-coef-not-applied", "kind:grad"),
    ("CLIP-GRADS", "fsdp1-mp-flat-keep-low", "fsdp1-clip-coef-not-clamped", "kind:grad"),
    ("CLIP-GRADS", "fsdp1-mp-uop", "fsdp1-summon-with-grads-raises", "kind:grads-unreadable"),
]


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(2)


def run(invariant: str, spec: CaseSpec, engine, scenario: str = "clip"):
    return evaluate(invariant, spec, observations(engine, spec, scenario, ClipObservation.from_dict))


@pytest.mark.gloo
@pytest.mark.parametrize("case", sorted(CASES))
def test_cases_hold_on_unmodified_torch(case, pool):
    spec = CASES[case]()
    for invariant in ("CLIP-NORM", "CLIP-GRADS"):
        res = run(invariant, spec, pool)
        assert res.verdict == PASS, res.describe()


@pytest.mark.gloo
@pytest.mark.parametrize("invariant,case,fault,kind", FAULTS, ids=[f"{f[0]}-{f[1]}-{f[2]}" for f in FAULTS])
def test_fault_is_caught_inside_the_ranks(invariant, case, fault, kind, pool):
    res = run(invariant, CASES[case](), pool, f"fault:clip:{fault}")
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


@pytest.mark.gloo
def test_a_norm_failing_on_one_rank_is_a_failure_not_a_hang(pool):
    """The norm raises on rank 1 only, before its reduction: rank 0 learns it
    from the local probe and does not enter the all-reduce (it would wait
    there for ever); CLIP-NORM reports rank 1's error, well before the
    pool's deadline."""
    spec = CASES["fsdp2-l2"]()
    obs = observations(pool, spec, "fault:clip:rank1-norm-raises", ClipObservation.from_dict)
    by_rank = {o.rank: o for o in obs}
    assert by_rank[1].clip_error.startswith("RuntimeError: injected"), by_rank[1]
    assert by_rank[0].peer_failed and by_rank[0].clip_error is None and by_rank[0].failed, by_rank[0]
    res = evaluate("CLIP-NORM", spec, obs)
    assert res.verdict == FAIL and any("kind:raised" in v.tags for v in res.violations), res.describe()
    assert evaluate("CLIP-GRADS", spec, obs).verdict == "UNCHECKED"


def test_the_reference_norm_is_the_definition():
    import math

    import torch

    from conformance.areas.common.clipping import reference_norm

    g = [torch.tensor([3.0, -4.0]), torch.zeros(0), torch.tensor([[12.0]])]
    assert reference_norm(g, 2.0) == pytest.approx(13.0)
    assert reference_norm(g, 1.0) == pytest.approx(19.0)
    assert reference_norm(g, math.inf) == pytest.approx(12.0)
    assert reference_norm([], 2.0) == reference_norm([torch.zeros(0)], math.inf) == 0.0


def test_the_clip_tags_carry_fsdp2_list_group_facts():
    """fully_shard([embed1, proj0]) with proj0 also registered as shared0
    (run again after the frozen Embedding completed the group; thorough,
    seed 1): the clip area's tags carry the fact
    fsdp2-list-group-reentered-loses-grad matches on, as the training areas'
    do."""
    from conformance.areas.clip.oracle import predict_clip
    from conformance.case.spec import ClipPlan, SharedModule

    tree = ModuleSpec("", "Model", children=(
        ModuleSpec("proj0", "Linear", (ParamSpec("weight", (1, 3), False), ParamSpec("bias", (1,)))),
        ModuleSpec("embed1", "Embedding", (ParamSpec("weight", (1, 3), False),)),
    ))
    spec = CaseSpec(tree=tree, classes=(ClassSpec("Model"),), shared=(SharedModule("", "shared0", "proj0"),), seed=0,
                    plan=WrapPlan(api="fsdp2", groups=(ShardGroup(("embed1", "proj0")),)), clip=ClipPlan())
    assert "group:rerun-after-frozen-embedding" in predict_clip(spec).tags
