"""COMM-COUNTS, COMM-ORDER, COMM-FSDP1-COUNTS and COMM-FSDP1-PREFETCH catch
faults injected into what FSDP communicates.

Each test shows a hand-written case holds on unmodified torch, then injects
one plausible regression inside the rank (the fake tier's in-process rank;
two of them inside a gloo pool's ranks too) through the test-only scenarios
of tests/self/faults_comm.py, and shows the invariant turns it into a FAIL
of the expected kind.
"""

from __future__ import annotations

import dataclasses

import pytest

from conformance.areas.comm.observation import CommObservation
from conformance.case.spec import CaseSpec, ClassSpec, CommPlan, CustomWrap, ModuleSpec, ParamSpec, ShardGroup, WrapPlan
from conformance.run.runner import FAIL, PASS, evaluate, observations
from tests.self import faults_comm  # noqa: F401  (registers the fault scenarios in the driver)

pytestmark = pytest.mark.selfcheck

LAYERS = ("layers.0", "layers.1", "layers.2")


def model(plan: WrapPlan, comm: CommPlan, *, frozen: tuple[str, ...] = ()) -> CaseSpec:
    """root (scale) -> layers: three blocks (w, proj: Linear 5x3, uneven over
    the ranks); ``frozen``: FQNs with requires_grad=False."""
    def p(fqn, name, shape):
        return ParamSpec(name, shape, fqn not in frozen)

    blocks = tuple(ModuleSpec(str(i), "Block", (p(f"layers.{i}.w", "w", (3,)),), children=(
        ModuleSpec("proj", "Linear", (p(f"layers.{i}.proj.weight", "weight", (5, 3)), p(f"layers.{i}.proj.bias", "bias", (5,)))),
    )) for i in range(3))
    tree = ModuleSpec("", "Model", (p("scale", "scale", (3,)),), children=(ModuleSpec("layers", "ModuleList", children=blocks),))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), plan=plan, comm=comm, seed=3)


def fsdp2(raf=None, root=None) -> WrapPlan:
    groups = tuple(ShardGroup((m,), raf) for m in LAYERS)
    return WrapPlan(api="fsdp2", groups=groups + ((ShardGroup(("",), root),) if root is not None else ()))


FSDP1 = WrapPlan(api="fsdp1", policy=CustomWrap(LAYERS))
UOP = WrapPlan(api="fsdp1", policy=CustomWrap(LAYERS), use_orig_params=True)
REFREEZE = ("layers.0.w", "layers.1.w", "layers.1.proj.weight", "layers.1.proj.bias")
BF16_FP32 = dict(param_dtype="bfloat16", reduce_dtype="float32")

def sequential_unit(comm: CommPlan, api: str = "fsdp1") -> CaseSpec:
    """root (scale) -> body: torch's Sequential of two Linears 5x3 (uneven
    over the ranks), its own FSDP1 unit, called through its wrapper as a
    user's model calls a Sequential (or given to fully_shard, ``api``
    "fsdp2") -> head (Linear 3x5)."""
    body = ModuleSpec("body", "Sequential", children=tuple(
        ModuleSpec(str(i), "Linear", (ParamSpec("weight", (5, 3)), ParamSpec("bias", (5,)))) for i in range(2)))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(
        body, ModuleSpec("head", "Linear", (ParamSpec("weight", (3, 5)),))))
    plan = (WrapPlan(api="fsdp1", policy=CustomWrap(("body", "head"))) if api == "fsdp1"
            else WrapPlan(api="fsdp2", groups=(ShardGroup(("body",)), ShardGroup(("head",)))))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"),), plan=plan, comm=comm, seed=3)


CASES = {
    "fsdp2-default": lambda: model(fsdp2(), CommPlan(iterations=2)),
    "fsdp2-no-reshard": lambda: model(fsdp2(False, False), CommPlan()),
    "fsdp2-frozen": lambda: model(fsdp2(True, True), CommPlan(), frozen=("layers.0.w", "layers.0.proj.weight", "layers.0.proj.bias", "layers.1.proj.bias")),
    "fsdp2-mp": lambda: model(fsdp2(), CommPlan(**BF16_FP32)),
    "fsdp2-one-rank": lambda: model(fsdp2(), CommPlan(world=1)),
    "fsdp2-int": lambda: model(fsdp2(2), CommPlan(iterations=2)),
    "fsdp2-explicit": lambda: model(fsdp2(), CommPlan(forward_prefetch=(("layers.0", ("layers.1", "layers.2")),),
                                                     backward_prefetch=(("layers.2", ("layers.1", "layers.0")),))),
    "fsdp2-sequential": lambda: sequential_unit(CommPlan(iterations=2), "fsdp2"),
    "fsdp1-full": lambda: model(FSDP1, CommPlan(iterations=2)),
    "fsdp1-sequential": lambda: sequential_unit(CommPlan(iterations=2)),
    "fsdp1-mp": lambda: model(FSDP1, CommPlan(**BF16_FP32)),
    "fsdp1-post": lambda: model(FSDP1, CommPlan(fsdp1_backward_prefetch="BACKWARD_POST")),
    "fsdp1-prefetch": lambda: model(FSDP1, CommPlan(iterations=2, fsdp1_forward_prefetch=True, limit_all_gathers=False)),
    # two iterations inside no_sync, then a synced one (upstream test_fsdp_comm.py's pattern)
    "fsdp1-no-sync-zero2": lambda: model(FSDP1, CommPlan(iterations=3, sharding_strategy="SHARD_GRAD_OP", fsdp1_no_sync=(True, True, False))),
    "fsdp1-no-sync-full": lambda: model(FSDP1, CommPlan(iterations=3, fsdp1_no_sync=(True, False, True), **BF16_FP32)),
    # after the first iteration, layers.1 frozen whole (no reduce-scatter for it then) and
    # layers.0.w unfrozen (its unit's reduce-scatter unchanged under FSDP1, larger under FSDP2)
    "fsdp1-refreeze": lambda: model(UOP, CommPlan(iterations=3, refreeze=REFREEZE), frozen=("layers.0.w",)),
    "fsdp2-refreeze": lambda: model(fsdp2(), CommPlan(iterations=3, refreeze=REFREEZE), frozen=("layers.0.w",)),
}

FAULTS = [
    ("COMM-COUNTS", "fsdp2-no-reshard", "fsdp2-unshard-ignores-unsharded", "kind:extra"),
    ("COMM-COUNTS", "fsdp2-sequential", "fsdp2-sequential-group-never-resharded", "kind:missing"),
    ("COMM-COUNTS", "fsdp2-frozen", "fsdp2-frozen-reduced", "kind:extra"),
    ("COMM-COUNTS", "fsdp2-frozen", "fsdp2-frozen-reduced", "kind:numel"),
    ("COMM-COUNTS", "fsdp2-mp", "fsdp2-reduce-in-param-dtype", "kind:dtype"),
    ("COMM-COUNTS", "fsdp2-one-rank", "fsdp2-one-rank-reduces", "kind:extra"),
    ("COMM-COUNTS", "fsdp2-int", "fsdp2-int-reshard-full-mesh", "kind:ranks"),
    ("COMM-ORDER", "fsdp2-default", "fsdp2-no-backward-prefetch", "kind:reshard-post_backward"),
    ("COMM-ORDER", "fsdp2-explicit", "fsdp2-forward-prefetch-ignored", "kind:reshard-forward"),
    ("COMM-ORDER", "fsdp2-default", "fsdp2-root-reshards-by-default", "kind:reshard-forward"),
    ("COMM-COUNTS", "fsdp2-default", "fsdp2-root-reshards-by-default", "kind:extra"),
    ("COMM-FSDP1-COUNTS", "fsdp1-full", "fsdp1-root-reshards-after-forward", "kind:extra"),
    ("COMM-FSDP1-COUNTS", "fsdp1-sequential", "fsdp1-sequential-unit-kept-after-forward", "kind:missing"),
    ("COMM-FSDP1-COUNTS", "fsdp1-mp", "fsdp1-reduce-in-param-dtype", "kind:dtype"),
    ("COMM-FSDP1-PREFETCH", "fsdp1-full", "fsdp1-backward-prefetch-ignored", "kind:not-prefetched"),
    ("COMM-FSDP1-PREFETCH", "fsdp1-full", "fsdp1-backward-prefetch-off-by-one", "kind:order"),
    ("COMM-FSDP1-PREFETCH", "fsdp1-post", "fsdp1-backward-prefetch-off-by-one", "kind:order"),
    ("COMM-FSDP1-PREFETCH", "fsdp1-full", "fsdp1-backward-pre-prefetches-post", "kind:context"),
    ("COMM-FSDP1-PREFETCH", "fsdp1-prefetch", "fsdp1-forward-prefetch-ignored", "kind:context"),
    ("COMM-FSDP1-COUNTS", "fsdp1-no-sync-zero2", "fsdp1-no-sync-frees-unsharded", "kind:extra"),
    ("COMM-FSDP1-COUNTS", "fsdp1-no-sync-zero2", "fsdp1-no-sync-ignored", "kind:extra"),
    ("COMM-FSDP1-COUNTS", "fsdp1-no-sync-full", "fsdp1-no-sync-ignored", "kind:extra"),
    # a unit frozen whole between iterations still reduce-scatters
    ("COMM-FSDP1-COUNTS", "fsdp1-refreeze", "fsdp1-flat-param-keeps-requires-grad", "kind:extra"),
    ("COMM-COUNTS", "fsdp2-refreeze", "fsdp2-unsharded-param-keeps-requires-grad", "kind:extra"),
]


def run(invariant: str, spec: CaseSpec, engine, scenario: str = "comm"):
    return evaluate(invariant, spec, observations(engine, spec, scenario, CommObservation.from_dict), known=[])


def _invariants(spec: CaseSpec) -> tuple[str, ...]:
    return ("COMM-COUNTS", "COMM-ORDER") if spec.plan.api == "fsdp2" else ("COMM-FSDP1-COUNTS", "COMM-FSDP1-PREFETCH")


@pytest.mark.parametrize("case", sorted(CASES))
def test_cases_hold_on_unmodified_torch(case, fake_engine):
    spec = CASES[case]()
    for invariant in _invariants(spec):
        res = run(invariant, spec, fake_engine)
        assert res.verdict == PASS, res.describe()


@pytest.mark.parametrize("invariant,case,fault,kind", FAULTS, ids=[f"{f[0]}-{f[2]}-{f[3]}" for f in FAULTS])
def test_fault_is_caught(invariant, case, fault, kind, fake_engine):
    res = run(invariant, CASES[case](), fake_engine, f"fault:comm:{fault}")
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(2)


@pytest.mark.gloo
@pytest.mark.parametrize("invariant,case,fault,kind", [FAULTS[0], next(f for f in FAULTS if f[2] == "fsdp1-backward-prefetch-ignored")], ids=["fsdp2", "fsdp1"])
def test_fault_is_caught_inside_the_pool_ranks(invariant, case, fault, kind, pool):
    spec = CASES[case]()
    assert run(invariant, spec, pool).verdict == PASS
    res = run(invariant, spec, pool, f"fault:comm:{fault}")
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


def test_a_refreeze_changes_what_the_oracle_promises_from_the_second_iteration():
    """layers.1 frozen whole after the first iteration: no reduce-scatter for
    it in the later ones; layers.0.w unfrozen: FSDP1's unit reduce-scatters
    its whole flat parameter either way, FSDP2's group more elements."""
    from conformance.areas.comm.oracle import predict_comm

    for case, rs in (("fsdp1-refreeze", "layers.1"), ("fsdp2-refreeze", "layers.1")):
        exp = predict_comm(CASES[case]()).expect(2)
        reduced = [[c.group for c in it.collectives if c.op == "reduce_scatter"] for it in exp.iterations]
        assert rs in reduced[0] and all(rs not in r for r in reduced[1:]), (case, reduced)
        numel = [{c.group: c.numel for c in it.collectives if c.op == "reduce_scatter"} for it in exp.iterations]
        grew = numel[1]["layers.0"] > numel[0]["layers.0"]
        assert grew == (case == "fsdp2-refreeze"), (case, numel)


@pytest.mark.gloo
@pytest.mark.parametrize("case,invariant,fault", [("fsdp1-refreeze", "COMM-FSDP1-COUNTS", "fsdp1-flat-param-keeps-requires-grad"),
                                                 ("fsdp2-refreeze", "COMM-COUNTS", "fsdp2-unsharded-param-keeps-requires-grad")])
def test_a_refreeze_holds_and_its_fault_is_caught_inside_the_pool_ranks(case, invariant, fault, pool):
    spec = CASES[case]()
    assert run(invariant, spec, pool).verdict == PASS
    res = run(invariant, spec, pool, f"fault:comm:{fault}")
    assert res.verdict == FAIL and any("kind:extra" in v.tags for v in res.violations), res.describe()


def test_backward_post_from_a_frozen_unit_is_not_promised(fake_engine):
    """BACKWARD_POST prefetches "after the current set of parameters'
    gradient computation": an all-frozen unit (use_orig_params=True) has
    none, and its reshard-only hook fires with its inputs' gradients, the
    moment the unit before it starts its own backward. Whether that unit is
    gathered by the prefetch or by its own pre-backward hook is autograd's
    hook order, not a promise (seed 2141 drew this case and FSDP gathered it
    in its pre-backward)."""
    from conformance.case.spec import ModuleWrap

    tree = ModuleSpec("", "ModelSeq", (), children=(
        ModuleSpec("0", "Block", (ParamSpec("weight", (1, 1), False), ParamSpec("bias", (1,), True))),
        ModuleSpec("1", "Block", (ParamSpec("weight", (1, 1), False),)),
    ))
    spec = CaseSpec(tree=tree, classes=(ClassSpec("ModelSeq", "Sequential"), ClassSpec("Block")),
                    plan=WrapPlan("fsdp1", ModuleWrap(("Block",)), True),
                    comm=CommPlan(iterations=1, fsdp1_backward_prefetch="BACKWARD_POST"))
    res = run("COMM-FSDP1-PREFETCH", spec, fake_engine)
    assert res.verdict == PASS, res.describe()


def _frozen_unit_after_nested_units() -> CaseSpec:
    """Thorough seed 72: units model0.model0 and its child
    model0.model0.model0 return one tensor (the child's output), which is
    the input of the all-frozen unit model0.model1 (use_orig_params=True,
    BACKWARD_POST)."""
    from conformance.case.spec import ModuleWrap

    tree = ModuleSpec("", "Model", (), children=(
        ModuleSpec("model0", "Model", (), children=(
            ModuleSpec("model0", "Model", (ParamSpec("weight", (1, 1), False),), children=(
                ModuleSpec("model0", "Model", (ParamSpec("weight", (1, 1), False), ParamSpec("bias", (1,), True))),
            )),
            ModuleSpec("model1", "Model", (ParamSpec("weight", (1, 1), False),)),
        )),
    ))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"),), plan=WrapPlan("fsdp1", ModuleWrap(("Model",)), True),
                    comm=CommPlan(iterations=1, fsdp1_backward_prefetch="BACKWARD_POST"))


def test_a_frozen_units_reshard_only_hook_fires_after_the_pre_backward_hooks_on_its_input():
    """The frozen unit's reshard-only post-backward hook is a hook on its
    input's gradient, registered at its pre-forward: it runs after the
    pre-backward hooks the units whose output that tensor is registered on
    it earlier. FSDP gathers model0.model0.model0 then model0.model0, each in
    its own pre-backward; the oracle had the frozen unit's hook prefetch
    model0.model0 first (thorough seed 72: COMM-FSDP1-PREFETCH FAILed on
    fake and gloo)."""
    from conformance.areas.common.comm_oracle import simulate_fsdp1

    spec = _frozen_unit_after_nested_units()
    backward = [(c.group, c.context) for c in simulate_fsdp1(spec, 4, spec.comm).iterations[0].collectives
                if c.phase == "backward" and c.op == "all_gather"]
    assert backward == [("model0.model1", "pre_backward model0.model1"),
                        ("model0.model0.model0", "pre_backward model0.model0.model0"),
                        ("model0.model0", "pre_backward model0.model0")], backward


def _frozen_linear_after_a_unit() -> CaseSpec:
    """Thorough seed 72's re-run: the all-frozen unit is a Linear, which the
    generic forward gives a view of the activation (x[:, None].expand): its
    reshard-only hook sits on that view and fires first, prefetching
    model0.model0 before that unit's own pre-backward."""
    from conformance.case.spec import SizeBasedWrap

    tree = ModuleSpec("", "Model", (), children=(
        ModuleSpec("model0", "Model", (), children=(
            ModuleSpec("model0", "Model", (ParamSpec("weight", (1, 1), False), ParamSpec("bias", (1,), True))),
            ModuleSpec("proj1", "Linear", (ParamSpec("weight", (1, 1), False),)),
        )),
    ))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"),), plan=WrapPlan("fsdp1", SizeBasedWrap(1), True),
                    comm=CommPlan(iterations=1, fsdp1_backward_prefetch="BACKWARD_POST"))


def test_a_frozen_linears_hook_on_a_view_fires_before_them():
    from conformance.areas.common.comm_oracle import simulate_fsdp1

    spec = _frozen_linear_after_a_unit()
    backward = [(c.group, c.context) for c in simulate_fsdp1(spec, 4, spec.comm).iterations[0].collectives
                if c.phase == "backward" and c.op == "all_gather"]
    assert backward == [("model0.proj1", "pre_backward model0.proj1"),
                        ("model0.model0", "post_backward model0.proj1 or pre_backward model0.model0")], backward


def _bf16(spec: CaseSpec) -> CaseSpec:
    """param_dtype bfloat16 (FSDP1's MixedPrecision casts the root's input
    only: cast_forward_inputs stays False; thorough seed 72 drew this form)."""
    import dataclasses

    return dataclasses.replace(spec, comm=dataclasses.replace(spec.comm, param_dtype="bfloat16"))


@pytest.mark.parametrize("case", [_frozen_unit_after_nested_units, _frozen_linear_after_a_unit,
                                  lambda: _bf16(_frozen_unit_after_nested_units())], ids=["nested", "linear", "nested-bf16"])
def test_the_frozen_units_hook_order_holds_on_torch(case, fake_engine):
    res = run("COMM-FSDP1-PREFETCH", case(), fake_engine)
    assert res.verdict == PASS, res.describe()


def test_a_unit_given_a_view_of_its_input_prefetches_out_of_order(fake_engine):
    """The fault: FSDP1 hands each unit a view of its input, so the frozen
    unit's reshard-only hook fires before the nested units' pre-backward
    hooks and prefetches the outer unit first. The oracle this session
    replaced allowed exactly that order (either the prefetch or the
    target's own pre-backward); it is now a FAIL."""
    res = run("COMM-FSDP1-PREFETCH", _frozen_unit_after_nested_units(), fake_engine, "fault:comm:fsdp1-unit-given-a-view-of-its-input")
    assert res.verdict == FAIL and any("kind:order" in v.tags for v in res.violations), res.describe()


def test_a_list_group_is_counted_as_one_group_and_its_event_order_unchecked(fake_engine):
    """fully_shard([layers.2, layers.0]): FSDP2 issues the group's
    collectives once, under the group as fully_shard was given it ("layers.2,
    layers.0", the oracle's name; the recorder named it by its first module
    only, so COMM-COUNTS failed every list group as one extra and one missing
    group). Its hooks' places among the other groups' are not modelled:
    COMM-ORDER and MB-COMMS say so instead of comparing."""
    from conformance.areas.microbatch.observation import MicrobatchObservation
    from conformance.case.spec import MicrobatchPlan

    plan = WrapPlan(api="fsdp2", groups=(ShardGroup(("layers.2", "layers.0")), ShardGroup(("layers.1",))))
    spec = model(plan, CommPlan(iterations=2))
    res = run("COMM-COUNTS", spec, fake_engine)
    assert res.verdict == PASS, res.describe()
    order = run("COMM-ORDER", spec, fake_engine)
    assert order.verdict != PASS and "multi-module FSDP2 group" in order.unchecked, order.describe()
    # the counts still catch a fault on such a case
    res = run("COMM-COUNTS", spec, fake_engine, "fault:comm:fsdp2-root-reshards-by-default")
    assert res.verdict == FAIL and any("kind:extra" in v.tags for v in res.violations), res.describe()
    mb = dataclasses.replace(spec, comm=None, microbatch=MicrobatchPlan())
    got = evaluate("MB-COMMS", mb, observations(fake_engine, mb, "microbatch", MicrobatchObservation.from_dict), known=[])
    assert got.verdict != PASS and "multi-module FSDP2 group" in got.unchecked, got.describe()



def test_a_prefetch_missing_before_a_nested_unit_is_not_prefetched():
    """Thorough seed 16651: forward_prefetch and BACKWARD_POST over 0 (with
    0.block2 nested in it) and 1. BACKWARD_POST's target after 1 is 0 (the
    previous unit in post-forward order), so with the prefetch missing (the
    recorded fsdp1-forward-prefetch-delays-post-backward) the first
    difference is 0.block2's own all-gather, not 0's: it was called an order
    and left FAIL. Every unit gathering in its own pre-backward from there,
    0 among them, is the missing prefetch; a prefetch of another unit
    instead (off by one) stays an order."""
    from conformance.areas.comm.invariants import _not_prefetched

    def ag(unit, context):
        return ("backward", "all_gather", unit, context)

    want = ag("0", "post_backward 1")
    seen = [ag("0.block2", "pre_backward 0.block2"), ag("0", "pre_backward 0")]
    assert _not_prefetched(want, seen)
    assert _not_prefetched(want, seen[1:])  # the flat form: the first difference is 0's own all-gather
    assert not _not_prefetched(want, [ag("0.block2", "post_backward 1"), ag("0", "pre_backward 0")])  # off by one
    assert not _not_prefetched(want, [ag("0.block2", "pre_backward 0.block2")])  # 0 never gathers: not this
    assert not _not_prefetched(ag("0", "pre_backward 0"), seen[1:])  # its own hook promised: no prefetch to miss


@pytest.mark.gloo
def test_the_unfrozen_groups_float32_reduce_scatter_is_known_and_no_other_groups(pool):
    """layers.1 frozen whole in the first iteration, unfrozen after it, under
    reduce_dtype=bfloat16: torch 2.13 reduce-scatters it in float32
    (fsdp2-unfreeze-frozen-group-mixed-precision). The oracle's reason on
    that group's reduce-scatter is what makes it KNOWN; with every group
    reducing in float32 (the fault), the other groups' dtype violations carry
    no such reason and the example FAILs."""
    from conformance.run import known

    layer1 = ("layers.1.w", "layers.1.proj.weight", "layers.1.proj.bias")
    spec = model(fsdp2(), CommPlan(iterations=2, reduce_dtype="bfloat16", refreeze=layer1), frozen=layer1)
    obs = observations(pool, spec, "comm", CommObservation.from_dict)
    res = evaluate("COMM-COUNTS", spec, obs, known=known.load())
    assert res.verdict == "KNOWN", res.describe()
    assert all("reason:trainable-later" in v.tags for v in res.violations), res.describe()
    faulty = observations(pool, spec, "fault:comm:fsdp2-reduce-in-param-dtype", CommObservation.from_dict)
    res = evaluate("COMM-COUNTS", spec, faulty, known=known.load())
    assert res.verdict == FAIL, res.describe()
