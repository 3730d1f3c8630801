"""MB-COMMS, MB-GRADS and MB-SHARDED catch faults injected into FSDP2's
schedule APIs.

Each test shows a hand-written case holds on unmodified torch, then injects
one plausible regression inside the rank (the fake tier's in-process rank;
the gradient and one communication fault inside a gloo pool's ranks, where
values are compared) through the test-only scenarios of
tests/self/faults_microbatch.py, and shows the invariant turns it into a
FAIL of the expected kind.
"""

from __future__ import annotations

import pytest

from conformance.areas.microbatch.observation import MicrobatchObservation
from conformance.areas.microbatch.oracle import stale_at_reset
from conformance.case.spec import (
    CaseSpec,
    ClassSpec,
    MicrobatchAbort,
    MicrobatchPlan,
    MicrobatchStep,
    ModuleSpec,
    ParamSpec,
    ShardGroup,
    WrapPlan,
)
from conformance.run import known
from conformance.run.runner import FAIL, KNOWN, PASS, UNCHECKED, evaluate, observations
from tests.self import faults_microbatch  # noqa: F401  (registers the fault scenarios in the driver)

pytestmark = pytest.mark.selfcheck

LAYERS = ("layers.0", "layers.1", "layers.2")
INVARIANTS = ("MB-COMMS", "MB-GRADS", "MB-SHARDED")
NO_SYNC = MicrobatchStep(sync=False, reshard_after_backward=False, is_last_backward=False)


def model(mb: MicrobatchPlan, raf=None) -> CaseSpec:
    """root (scale) -> layers: three blocks (w, proj: Linear 5x4: Shard(0)
    pads 5 rows, dim 1 divides 2 and 4 ranks)."""
    blocks = tuple(ModuleSpec(str(i), "Block", (ParamSpec("w", (4,)),), children=(
        ModuleSpec("proj", "Linear", (ParamSpec("weight", (5, 4)), ParamSpec("bias", (5,)))),
    )) for i in range(3))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(ModuleSpec("layers", "ModuleList", children=blocks),))
    plan = WrapPlan(api="fsdp2", groups=tuple(ShardGroup((m,), raf) for m in LAYERS))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), plan=plan, microbatch=mb, seed=5)


def embedding_model(mb: MicrobatchPlan) -> CaseSpec:
    """root (scale) -> emb: Embedding 6x4, proj: Linear 5x4; each its own
    group; the Embedding's weight is not read by the backward."""
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(
        ModuleSpec("emb", "Embedding", (ParamSpec("weight", (6, 4)),)),
        ModuleSpec("proj", "Linear", (ParamSpec("weight", (5, 4)), ParamSpec("bias", (5,)))),
    ))
    plan = WrapPlan(api="fsdp2", groups=(ShardGroup(("emb",)), ShardGroup(("proj",))))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"),), plan=plan, microbatch=mb, seed=7)


CASES = {
    "no-sync": lambda: model(MicrobatchPlan((NO_SYNC, MicrobatchStep(sync=False), MicrobatchStep()))),
    "unshard": lambda: model(MicrobatchPlan((MicrobatchStep(sync=False), MicrobatchStep(unshard="layers.1", unshard_async=True),
                                             MicrobatchStep(unshard="layers.2", reshard=True)))),
    "shard-dim1": lambda: model(MicrobatchPlan((NO_SYNC, MicrobatchStep()), shard_dim1=("layers.0", "layers.2"))),
    "int-reshard": lambda: model(MicrobatchPlan((MicrobatchStep(), MicrobatchStep(reshard_after_forward=False))), raf=2),
    # an iteration aborted (after a synced microbatch: nothing accumulated) and reset_iter_state()
    "abort-forward": lambda: model(MicrobatchPlan((MicrobatchStep(), MicrobatchStep()), abort=MicrobatchAbort(1, "layers.1", "forward"))),
    "abort-backward": lambda: model(MicrobatchPlan((MicrobatchStep(), MicrobatchStep()),
                                                   abort=MicrobatchAbort(1, "layers.1.proj", "backward"))),
    # aborted when the root's forward returns: every block's group completed its forward
    "abort-at-root": lambda: model(MicrobatchPlan((MicrobatchStep(), MicrobatchStep()), abort=MicrobatchAbort(0, "", "forward"))),
    # set_unshard_in_backward(False) on the Embedding's group and the root's (its own parameter only)
    "no-unshard-in-backward": lambda: embedding_model(MicrobatchPlan((NO_SYNC, MicrobatchStep()), no_unshard_in_backward=("emb", ""))),
    # all-reduce hooks (scales of their own) on a block's group and the
    # root's; the suite's custom comms on another block's and the root's
    "hooks-and-custom-comms": lambda: model(MicrobatchPlan((NO_SYNC, MicrobatchStep(), MicrobatchStep()),
                                                           all_reduce_hook=(("layers.0", 2.0), ("", 0.5)), custom_comms=("layers.1", ""))),
    # rank 0 passes over layers.1's proj (in its group) and then layers.2's
    # (in its group too), with set_reduce_scatter_unused_params(True)
    "unused-on-rank0": lambda: model(MicrobatchPlan((MicrobatchStep(sync=False, unused_on_rank0=("layers.1.proj",)), MicrobatchStep(),
                                                     MicrobatchStep(unused_on_rank0=("layers.2.proj",))), reduce_scatter_unused_params=True)),
    # post-accumulate-grad hooks on every trainable parameter: synced twice (layers.2's after an unsynced microbatch)
    "grad-hooks": lambda: model(MicrobatchPlan((MicrobatchStep(), NO_SYNC, MicrobatchStep()), grad_hooks=True)),
    # reduce-scatters on a group of their own, back on the shard group, then on a new one
    "separate-reduce-scatter": lambda: model(MicrobatchPlan((MicrobatchStep(separate_reduce_scatter=True),
                                                             MicrobatchStep(separate_reduce_scatter=False),
                                                             MicrobatchStep(separate_reduce_scatter=True)))),
}
# HSDP: reduce-scatter without the replicate all-reduce, then unsynced,
# then both (set_requires_all_reduce's gradient accumulation), an all-reduce
# hook on a block's group; on the fake tier's 4 ranks and a 2-rank pool
HSDP_STEPS = (MicrobatchStep(all_reduce=False), MicrobatchStep(sync=False, all_reduce=False), MicrobatchStep())
HSDP_CASES = {
    "hsdp-2x2": lambda: model(MicrobatchPlan(HSDP_STEPS, mesh=(2, 2), all_reduce_hook=(("layers.0", 2.0),))),
    "hsdp-2x1": lambda: model(MicrobatchPlan(HSDP_STEPS, mesh=(2, 1), all_reduce_hook=(("layers.0", 2.0),))),
    "hsdp-1x2": lambda: model(MicrobatchPlan(HSDP_STEPS, mesh=(1, 2), all_reduce_hook=(("layers.0", 2.0),))),
}

FAULTS = [
    ("MB-COMMS", "no-sync", "gradient-sync-ignored", "kind:extra"),
    ("MB-COMMS", "no-sync", "reshard-after-backward-ignored", "kind:extra"),
    ("MB-COMMS", "unshard", "explicit-unshard-ignored", "kind:unshard-forward"),
    ("MB-COMMS", "shard-dim1", "shard-placement-fn-ignored", "kind:numel"),
    ("MB-SHARDED", "no-sync", "reshard-after-backward-sticks", "kind:unsharded-param"),
    ("MB-COMMS", "abort-forward", "reset-leaves-groups-unsharded", "kind:missing"),
    ("MB-COMMS", "abort-backward", "reset-iter-state-skipped", "kind:missing"),
    ("MB-COMMS", "no-unshard-in-backward", "unshard-in-backward-ignored", "kind:extra"),
    # the mutant fsdp2-reset-iter-state-keeps-post-forward-order, which 300 drawn examples missed
    ("MB-COMMS", "abort-at-root", "reset-keeps-post-forward-order", "kind:extra"),
    ("MB-COMMS", "hooks-and-custom-comms", "all-reduce-hook-ignored", "op:all_reduce_hook"),
    ("MB-COMMS", "hooks-and-custom-comms", "custom-all-gather-ignored", "via:custom"),
    ("MB-COMMS", "hooks-and-custom-comms", "custom-reduce-scatter-ignored", "via:custom"),
    ("MB-COMMS", "unused-on-rank0", "unused-params-flag-ignored", "kind:numel"),
    ("MB-COMMS", "separate-reduce-scatter", "separate-rs-group-ignored", "pg:separate"),
    ("MB-COMMS", "separate-reduce-scatter", "separate-rs-group-per-group", "pg:separate"),
    ("MB-COMMS", "separate-reduce-scatter", "separate-rs-group-disable-ignored", "pg:separate"),
    ("MB-GRADS", "grad-hooks", "grad-hooks-skipped", "kind:hook-not-run"),
    ("MB-GRADS", "grad-hooks", "grad-hooks-before-accumulation", "kind:hook-stale"),
    ("MB-COMMS", "hsdp-2x2", "all-reduce-flag-ignored", "op:all_reduce"),
    ("MB-COMMS", "hsdp-2x2", "all-reduce-flag-ignored", "op:all_reduce_hook"),
]
GLOO_FAULTS = [
    ("MB-GRADS", "no-sync", "unsynced-grads-dropped", "kind:grad"),
    ("MB-GRADS", "no-sync", "grad-element-nan", "kind:grad"),
    ("MB-COMMS", "no-sync", "gradient-sync-ignored", "kind:extra"),
    # the read of the gradients' full values raising: MB-GRADS' verdict, not the scenario's own error
    ("MB-GRADS", "no-sync", "full-tensor-raises", "at:read"),
    ("MB-GRADS", "abort-forward", "reset-iter-state-skipped", "kind:grad"),
    ("MB-SHARDED", "abort-backward", "reset-iter-state-skipped", "kind:unsharded-param"),
    ("MB-GRADS", "no-unshard-in-backward", "unshard-in-backward-skips-forward", "kind:raised"),
    ("MB-GRADS", "hooks-and-custom-comms", "all-reduce-hook-ignored", "kind:grad"),
    # the hook runs (MB-COMMS holds) but its in-place work is lost
    ("MB-GRADS", "hooks-and-custom-comms", "all-reduce-hook-on-a-copy", "kind:grad"),
    ("MB-GRADS", "unused-on-rank0", "unused-params-nonzero-grad", "kind:grad"),
    ("MB-COMMS", "separate-reduce-scatter", "separate-rs-group-per-group", "pg:separate"),
    ("MB-GRADS", "grad-hooks", "grad-hooks-skipped", "kind:hook-not-run"),
    ("MB-GRADS", "hsdp-1x2", "partial-reduce-dropped", "kind:grad"),
    ("MB-GRADS", "hsdp-2x1", "partial-reduce-dropped", "kind:grad"),
    ("MB-GRADS", "hsdp-2x1", "all-reduce-hook-ignored", "kind:grad"),
]


CASES.update(HSDP_CASES)
ONE_D = set(CASES) - set(HSDP_CASES)


def run(invariant: str, spec: CaseSpec, engine, scenario: str = "microbatch"):
    return evaluate(invariant, spec, observations(engine, spec, scenario, MicrobatchObservation.from_dict), known=[])


@pytest.mark.parametrize("case", sorted(ONE_D | {"hsdp-2x2"}))  # the fake tier's 4 ranks
def test_cases_hold_on_unmodified_torch(case, fake_engine):
    spec = CASES[case]()
    for invariant in ("MB-COMMS", "MB-SHARDED"):
        res = run(invariant, spec, fake_engine)
        assert res.verdict == PASS, res.describe()


def test_mb_grads_on_the_fake_tier_passes_on_hooks_compared_and_is_unchecked_without(fake_engine):
    """The fake tier compares no gradient values, but the post-accumulate-grad
    hooks are structure: with hooks drawn the example was checked (PASS),
    without them nothing was (UNCHECKED)."""
    assert run("MB-GRADS", CASES["grad-hooks"](), fake_engine).verdict == PASS
    assert run("MB-GRADS", CASES["no-sync"](), fake_engine).verdict == UNCHECKED


@pytest.mark.parametrize("invariant,case,fault,kind", FAULTS, ids=[f"{f[0]}-{f[2]}-{f[3]}" for f in FAULTS])
def test_fault_is_caught(invariant, case, fault, kind, fake_engine):
    res = run(invariant, CASES[case](), fake_engine, f"fault:microbatch:{fault}")
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(2)


@pytest.mark.gloo
@pytest.mark.parametrize("case", sorted(set(CASES) - {"int-reshard", "hsdp-2x2"}))  # 2 is no non-trivial divisor of 2 ranks; 2x2 needs 4
def test_cases_hold_in_the_pool_ranks(case, pool):
    spec = CASES[case]()
    for invariant in INVARIANTS:
        res = run(invariant, spec, pool)
        assert res.verdict == PASS, res.describe()


@pytest.mark.gloo
@pytest.mark.parametrize("invariant,case,fault,kind", GLOO_FAULTS, ids=[f"{f[0]}-{f[2]}" for f in GLOO_FAULTS])
def test_fault_is_caught_inside_the_pool_ranks(invariant, case, fault, kind, pool):
    res = run(invariant, CASES[case](), pool, f"fault:microbatch:{fault}")
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


def test_a_raise_reading_the_parameters_is_mb_shardeds_verdict():
    """Reading the registered parameters after the last microbatch raised
    (the adapter's read_error, no shard seen): MB-SHARDED fails at:read
    rather than saying nothing was compared; MB-GRADS too."""
    spec = CASES["no-sync"]()
    obs = [MicrobatchObservation("fsdp2", r, 2, "gloo", "x", read_error="parameters: AttributeError: no w") for r in range(2)]
    for invariant in ("MB-SHARDED", "MB-GRADS"):
        res = evaluate(invariant, spec, obs, known=[])
        assert res.verdict == FAIL, res.describe()
        assert all({"at:read", "kind:raised", "raised:AttributeError"} <= v.tags for v in res.violations), res.describe()


UNSYNCED = MicrobatchStep(sync=False)
LAYER2 = {"layers.2.w", "layers.2.proj.weight", "layers.2.proj.bias"}
STALE_CASES = [
    # the microbatches, the abort, the parameters FSDP2 still holds an unsharded gradient of at the reset
    ((UNSYNCED, MicrobatchStep()), MicrobatchAbort(0, "layers.1.proj", "backward"), LAYER2),
    ((MicrobatchStep(), UNSYNCED, MicrobatchStep()), MicrobatchAbort(2, "layers.0", "forward"), "all"),
    # the aborted, synced backward reduces layers.2's accumulated gradients with its own
    ((MicrobatchStep(), UNSYNCED, MicrobatchStep()), MicrobatchAbort(2, "layers.1.proj", "backward"), "all but layers.2"),
]


@pytest.mark.gloo
@pytest.mark.parametrize("steps,abort,stale", STALE_CASES, ids=["backward-unsynced", "forward-after-unsynced", "backward-synced-reduces"])
def test_the_gradients_reset_iter_state_keeps_are_the_oracles_and_known_only_there(steps, abort, stale, pool):
    """fsdp2-reset-iter-state-keeps-unsynced-grads: the parameters whose
    gradients come out off after the reset and the restart are exactly the
    oracle's stale_at_reset (unsynced accumulation before the abort, and
    what an aborted backward computed and did not reduce), and those
    violations alone are KNOWN: the same case with one element of every
    reduced gradient NaN still FAILs on the others."""
    spec = model(MicrobatchPlan(steps, abort=abort))
    every = {"scale"} | {f"{b}.{n}" for b in LAYERS for n in ("w", "proj.weight", "proj.bias")}
    want = every if stale == "all" else every - LAYER2 if stale == "all but layers.2" else stale
    assert stale_at_reset(spec) == want
    res = run("MB-GRADS", spec, pool)
    assert res.verdict == FAIL and {v.message.split(":")[0] for v in res.violations} == want, res.describe()
    assert all("grad:stale-at-reset" in v.tags for v in res.violations), res.describe()
    res = evaluate("MB-GRADS", spec, observations(pool, spec, "microbatch", MicrobatchObservation.from_dict), known=known.load())
    assert res.verdict == KNOWN, res.describe()
    if want != every:
        res = evaluate("MB-GRADS", spec, observations(pool, spec, "fault:microbatch:grad-element-nan", MicrobatchObservation.from_dict),
                       known=known.load())
        assert res.verdict == FAIL and {v.message.split(":")[0] for v in res.violations} == every - want, res.describe()
