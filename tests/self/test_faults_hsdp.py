"""HSDP-PARITY, HSDP-REPLICAS, HSDP-DEGENERATE, HSDP-LAYOUT,
HSDP-STATE-DICT and HSDP-COMMS catch faults injected into HSDP.

Each test shows the hand-written cases hold on unmodified torch (on a
4-rank gloo pool: (2, 2), (4, 1), (1, 4)), then injects one plausible
regression of FSDP2's 2-D mesh path, FSDP1's hybrid strategies or the full
state dict's load inside the ranks (through the test-only scenarios of
tests/self/faults_hsdp.py) and shows the invariant turns it into a FAIL of
the expected kind.
"""

from __future__ import annotations

import pytest

from conformance.areas.hsdp.observation import HsdpObservation
from conformance.case.spec import BufferSpec, CaseSpec, ClassSpec, CustomWrap, HsdpPlan, ModuleSpec, ParamSpec, ShardGroup, WrapPlan
from conformance.run.runner import FAIL, KNOWN, PASS, UNCHECKED, evaluate, observations
from tests.self import faults_hsdp  # noqa: F401  (registers the fault scenarios in the driver)

pytestmark = pytest.mark.selfcheck

INVARIANTS = ("HSDP-PARITY", "HSDP-REPLICAS", "HSDP-DEGENERATE", "HSDP-LAYOUT", "HSDP-STATE-DICT", "HSDP-COMMS", "HSDP-SYNC")


def model(plan: WrapPlan, hsdp: HsdpPlan, *, frozen_bias: bool = False) -> CaseSpec:
    """root (scale) -> block (w, buffer b; proj: Linear 3x3) and head (Linear
    1x3: an empty FSDP2 shard past the first shard rank)."""
    block = ModuleSpec("block", "Block", (ParamSpec("w", (3,)),), (BufferSpec("b", (2,)),), children=(
        ModuleSpec("proj", "Linear", (ParamSpec("weight", (3, 3)), ParamSpec("bias", (3,), not frozen_bias))),
    ))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(block, ModuleSpec("head", "Linear", (ParamSpec("weight", (1, 3)),))))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), plan=plan, hsdp=hsdp, seed=5)


FSDP2 = WrapPlan(api="fsdp2", groups=(ShardGroup(("block",)),))
FSDP1 = WrapPlan(api="fsdp1", policy=CustomWrap(("block",)))
FSDP1_UOP = WrapPlan(api="fsdp1", policy=CustomWrap(("block",)), use_orig_params=True)

CASES = {
    "fsdp2-2x2": lambda: model(FSDP2, HsdpPlan((2, 2))),
    "fsdp2-2x2-adam-frozen": lambda: model(FSDP2, HsdpPlan((2, 2), optimizer="Adam", steps=3), frozen_bias=True),
    "fsdp2-4x1": lambda: model(FSDP2, HsdpPlan((4, 1))),
    "fsdp2-1x4": lambda: model(FSDP2, HsdpPlan((1, 4))),
    "fsdp1-mesh-2x2": lambda: model(FSDP1, HsdpPlan((2, 2), "fsdp1-mesh")),
    "fsdp1-pg-2x2-zero2": lambda: model(FSDP1_UOP, HsdpPlan((2, 2), "fsdp1-pg", "_HYBRID_SHARD_ZERO2")),
    "fsdp1-pg-1x4": lambda: model(FSDP1, HsdpPlan((1, 4), "fsdp1-pg")),
}
# what an invariant compares nothing on, by design
NOT_APPLICABLE = {("HSDP-REPLICAS", "fsdp2-1x4"), ("HSDP-REPLICAS", "fsdp1-pg-1x4")} | {
    ("HSDP-DEGENERATE", c) for c in CASES if "2x2" in c}

FAULTS = [
    ("HSDP-PARITY", "fsdp2-2x2", "no-replicate-all-reduce", "kind:param"),
    ("HSDP-PARITY", "fsdp1-mesh-2x2", "no-replicate-all-reduce", "kind:param"),
    ("HSDP-REPLICAS", "fsdp2-2x2", "no-replicate-all-reduce", "kind:replica-grad"),
    ("HSDP-REPLICAS", "fsdp1-pg-2x2-zero2", "no-replicate-all-reduce", "kind:replica-param"),
    ("HSDP-DEGENERATE", "fsdp2-4x1", "no-replicate-all-reduce", "kind:grads-not-all-reduced"),
    ("HSDP-DEGENERATE", "fsdp2-1x4", "one-rank-replicate-all-reduces-world", "kind:final-shard"),
    ("HSDP-LAYOUT", "fsdp2-2x2", "mesh-dims-swapped", "kind:local-shape"),
    ("HSDP-LAYOUT", "fsdp1-pg-1x4", "fsdp1-pg-pair-swapped", "kind:local-numel"),
    ("HSDP-STATE-DICT", "fsdp2-2x2", "full-state-dict-load-dropped", "kind:to-flat"),
    ("HSDP-STATE-DICT", "fsdp1-mesh-2x2", "full-state-dict-load-dropped", "kind:from-flat"),
    ("HSDP-STATE-DICT", "fsdp2-1x4", "dcp-load-dropped", "kind:dcp-to-flat"),
    ("HSDP-STATE-DICT", "fsdp1-pg-2x2-zero2", "dcp-load-dropped", "kind:dcp-to-flat"),
    ("HSDP-COMMS", "fsdp2-2x2", "no-replicate-all-reduce", "kind:missing"),
    ("HSDP-COMMS", "fsdp1-pg-2x2-zero2", "no-replicate-all-reduce", "kind:missing"),
    ("HSDP-SYNC", "fsdp2-2x2", "sync-buffers-first-replica-only", "kind:not-synced"),
    ("HSDP-SYNC", "fsdp2-2x2-adam-frozen", "full-state-dict-load-dropped", "kind:not-synced"),
]
# FSDP1's sync_module_states rejects CPU modules (fsdp1-sync-module-states-rejects-cpu)
KNOWN_ON_CPU = {("HSDP-SYNC", c) for c in CASES if c.startswith("fsdp1")}


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(4)


def run(invariant: str, spec: CaseSpec, engine, scenario: str = "hsdp"):
    return evaluate(invariant, spec, observations(engine, spec, scenario, HsdpObservation.from_dict))


@pytest.mark.gloo
@pytest.mark.parametrize("case", sorted(CASES))
def test_cases_hold_on_unmodified_torch(case, pool):
    spec = CASES[case]()
    obs = observations(pool, spec, "hsdp", HsdpObservation.from_dict)
    for invariant in INVARIANTS:
        res = evaluate(invariant, spec, obs)
        want = UNCHECKED if (invariant, case) in NOT_APPLICABLE else KNOWN if (invariant, case) in KNOWN_ON_CPU else PASS
        assert res.verdict == want, res.describe()


@pytest.mark.gloo
@pytest.mark.parametrize("invariant,case,fault,kind", FAULTS, ids=[f"{f[0]}-{f[1]}-{f[2]}" for f in FAULTS])
def test_fault_is_caught_inside_the_ranks(invariant, case, fault, kind, pool):
    res = run(invariant, CASES[case](), pool, f"fault:hsdp:{fault}")
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


@pytest.mark.gloo
@pytest.mark.parametrize("case", ["fsdp1-mesh-2x2", "fsdp1-pg-2x2-zero2"])
def test_fsdp1_sync_reaches_the_buffers_of_the_modules_under_a_unit(case, pool):
    """With FSDP1's GPU check off (on CPU its sync raises: the recorded
    finding), the hybrid sync holds; syncing each unit's own buffers only
    leaves those of head (under the root unit) and block.proj (under
    block's) as each rank seeded them, and HSDP-SYNC names them."""
    spec = CASES[case]()
    res = run("HSDP-SYNC", spec, pool, "fault:hsdp:fsdp1-sync-allowed-on-cpu")
    assert res.verdict == PASS, res.describe()
    res = run("HSDP-SYNC", spec, pool, "fault:hsdp:fsdp1-sync-own-buffers-only")
    assert res.verdict == FAIL and all("kind:not-synced" in v.tags for v in res.violations), res.describe()
    for name in ("head.hsdp_sync_persistent", "block.proj.hsdp_sync_persistent", "block.proj.hsdp_sync_non_persistent"):
        assert name in res.describe(), res.describe()


def test_local_shape_is_torch_chunk():
    import torch

    from conformance.areas.hsdp.oracle import local_shape

    for rows in (0, 1, 3, 5, 8):
        for shard in (1, 2, 4):
            chunks = torch.empty(rows, 2).chunk(shard) if rows else ()
            for j in range(shard):
                want = tuple(chunks[j].shape) if j < len(chunks) else (0, 2)
                assert local_shape((rows, 2), shard, j) == want, (rows, shard, j)


@pytest.mark.gloo
def test_fsdp2_list_group_finding_is_known_on_a_2d_mesh(pool):
    """fully_shard([a.proj, b.emb]) on a (2, 2) mesh, both frozen, the
    Embedding run last (seed 4242's case, reduced): the backward through the
    Linear finds the group freed (fsdp2-frozen-list-group-freed-in-backward,
    the same mechanism as on a flat mesh) and HSDP-PARITY reads it KNOWN,
    its tags carrying the FSDP2 list-group fact."""
    a = ModuleSpec("a", "Block", children=(ModuleSpec("proj", "Linear", (ParamSpec("weight", (2, 2), False),)),))
    b = ModuleSpec("b", "Block", children=(ModuleSpec("emb", "Embedding", (ParamSpec("weight", (3, 2), False),)),))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (2,)),), children=(a, b))
    spec = CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), seed=5, hsdp=HsdpPlan((2, 2)),
                    plan=WrapPlan(api="fsdp2", groups=(ShardGroup(("a.proj", "b.emb")),)))
    res = run("HSDP-PARITY", spec, pool)
    assert res.verdict == KNOWN and {f for _, f in res.known} == {"fsdp2-frozen-list-group-freed-in-backward"}, res.describe()
    assert all("group:multi-frozen-embedding" in v.tags for v, _ in res.known)


@pytest.mark.gloo
def test_sync_of_a_module_holding_a_parameter_twice_is_known(pool):
    """A module holding the root's weight under two names (seed 4242's case):
    set_model_state_dict(broadcast_from_rank0=True) on the (2, 2) mesh fails
    on every rank (rank 0 on the copy, the others on the key the broadcast
    dropped), as fsdp2-set-model-state-dict-shared-module records for a flat
    mesh: HSDP-SYNC reads it KNOWN, and the ranks' different texts are no
    RANKS-AGREE violation."""
    from conformance.case.spec import TiedParam
    from conformance.run.runner import KNOWN

    tree = ModuleSpec("", "Model", (ParamSpec("weight", (3, 1)),), children=(ModuleSpec("model0", "Model"),))
    spec = CaseSpec(tree=tree, classes=(ClassSpec("Model"),), seed=5, hsdp=HsdpPlan((2, 2), steps=1),
                    ties=(TiedParam("model0", "tied0", "weight"), TiedParam("model0", "tied1", "weight")), plan=WrapPlan(api="fsdp2"))
    res = run("HSDP-SYNC", spec, pool)
    assert res.verdict == KNOWN and {f for _, f in res.known} == {"fsdp2-set-model-state-dict-shared-module"}, res.describe()


def _tied_frozen_root(mesh=(4, 1), steps=2) -> CaseSpec:
    """Thorough seed 95's case: the root's frozen weight tied to its own
    tied0, a trainable Linear its own unit, FSDP1 HYBRID_SHARD with
    use_orig_params=True."""
    from conformance.case.spec import ModuleWrap, TiedParam

    tree = ModuleSpec("", "Model", (ParamSpec("weight", (1, 1), False),),
                      children=(ModuleSpec("lora0", "Linear", (ParamSpec("weight", (1, 1)),)),))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"),), ties=(TiedParam("", "tied0", "weight"),),
                    plan=WrapPlan(api="fsdp1", policy=ModuleWrap(("Linear",)), use_orig_params=True),
                    hsdp=HsdpPlan(mesh, way="fsdp1-mesh", strategy="HYBRID_SHARD", steps=steps))


@pytest.mark.gloo
@pytest.mark.parametrize("steps", [2, 1])
def test_a_tied_frozen_unit_over_a_one_rank_shard_group_is_the_no_shard_finding(steps, pool):
    """HYBRID_SHARD over a (4, 1) mesh runs NO_SHARD in the one-rank shard
    group, so fsdp1-no-shard-frozen-unit-params-unregistered's tied form
    shows: with two steps the second forward asserts on the shared parameter,
    with one step summon_full_params after it does. Both are HSDP-PARITY's
    raise, read KNOWN (the one-step form was the scenario's own error, ERROR
    on every HSDP invariant, before the adapter caught the read)."""
    spec = _tied_frozen_root(steps=steps)
    obs = observations(pool, spec, "hsdp", HsdpObservation.from_dict)
    res = evaluate("HSDP-PARITY", spec, obs)
    assert res.verdict == KNOWN and {f for _, f in res.known} == {"fsdp1-no-shard-frozen-unit-params-unregistered"}, res.describe()
    assert all("cause:shared-param-not-parameter" in v.tags for v, _ in res.known)


def test_the_no_shard_tied_form_needs_its_assertion_and_the_one_rank_shard_group():
    """The same raise on a (2, 2) mesh (FULL_SHARD within the shard group),
    or another AssertionError on the (4, 1) mesh, is no form of the finding."""
    import torch

    msg = "AssertionError: as_params=True type(prim_param)=<class 'torch.Tensor'>"

    def obs(mesh, error):
        return [HsdpObservation(api="fsdp1", rank=r, world_size=4, backend="gloo", torch_version=torch.__version__,
                                mesh=mesh, step_error=error) for r in range(4)]

    spec = _tied_frozen_root()
    assert evaluate("HSDP-PARITY", spec, obs((4, 1), msg)).verdict == KNOWN
    other = evaluate("HSDP-PARITY", spec, obs((4, 1), "AssertionError: FSDP assumes x is in the state_dict"))
    assert other.verdict == FAIL, other.describe()
    square = _tied_frozen_root(mesh=(2, 2))
    res = evaluate("HSDP-PARITY", square, obs((2, 2), msg))
    assert res.verdict == FAIL, res.describe()
