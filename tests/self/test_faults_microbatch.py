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
from conformance.case.spec import CaseSpec, ClassSpec, MicrobatchPlan, MicrobatchStep, ModuleSpec, ParamSpec, ShardGroup, WrapPlan
from conformance.run.runner import FAIL, PASS, evaluate, observations
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


CASES = {
    "no-sync": lambda: model(MicrobatchPlan((NO_SYNC, MicrobatchStep(sync=False), MicrobatchStep()))),
    "unshard": lambda: model(MicrobatchPlan((MicrobatchStep(sync=False), MicrobatchStep(unshard="layers.1", unshard_async=True),
                                             MicrobatchStep(unshard="layers.2", reshard=True)))),
    "shard-dim1": lambda: model(MicrobatchPlan((NO_SYNC, MicrobatchStep()), shard_dim1=("layers.0", "layers.2"))),
    "int-reshard": lambda: model(MicrobatchPlan((MicrobatchStep(), MicrobatchStep(reshard_after_forward=False))), raf=2),
}

FAULTS = [
    ("MB-COMMS", "no-sync", "gradient-sync-ignored", "kind:extra"),
    ("MB-COMMS", "no-sync", "reshard-after-backward-ignored", "kind:extra"),
    ("MB-COMMS", "unshard", "explicit-unshard-ignored", "kind:unshard-forward"),
    ("MB-COMMS", "shard-dim1", "shard-placement-fn-ignored", "kind:numel"),
    ("MB-SHARDED", "no-sync", "reshard-after-backward-sticks", "kind:unsharded-param"),
]
GLOO_FAULTS = [
    ("MB-GRADS", "no-sync", "unsynced-grads-dropped", "kind:grad"),
    ("MB-GRADS", "no-sync", "grad-element-nan", "kind:grad"),
    ("MB-COMMS", "no-sync", "gradient-sync-ignored", "kind:extra"),
    # the read of the gradients' full values raising: MB-GRADS' verdict, not the scenario's own error
    ("MB-GRADS", "no-sync", "full-tensor-raises", "at:read"),
]


def run(invariant: str, spec: CaseSpec, engine, scenario: str = "microbatch"):
    return evaluate(invariant, spec, observations(engine, spec, scenario, MicrobatchObservation.from_dict), known=[])


@pytest.mark.parametrize("case", sorted(CASES))
def test_cases_hold_on_unmodified_torch(case, fake_engine):
    spec = CASES[case]()
    for invariant in ("MB-COMMS", "MB-SHARDED"):
        res = run(invariant, spec, fake_engine)
        assert res.verdict == PASS, res.describe()


@pytest.mark.parametrize("invariant,case,fault,kind", FAULTS, ids=[f"{f[0]}-{f[2]}-{f[3]}" for f in FAULTS])
def test_fault_is_caught(invariant, case, fault, kind, fake_engine):
    res = run(invariant, CASES[case](), fake_engine, f"fault:microbatch:{fault}")
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(2)


@pytest.mark.gloo
@pytest.mark.parametrize("case", sorted(set(CASES) - {"int-reshard"}))  # 2 is no non-trivial divisor of 2 ranks
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
