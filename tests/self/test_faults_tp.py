"""TP-LAYOUT, TP-FULL-TENSOR, TP-PARITY, TP-STATE-DICT, TP-MP-DTYPE and
TP-CLIP catch faults injected into tensor parallelism + FSDP2.

Each test shows the hand-written cases hold on unmodified torch (on a
4-rank gloo pool: the (2, 2) mesh), then injects one plausible regression
of the parallel styles, FSDP2's 2-D path, its mixed precision, the full
state dict's load or clip_grad_norm_ inside the ranks (through the
test-only scenarios of tests/self/faults_tp.py) and shows the invariant
turns it into a FAIL of the expected kind.
"""

from __future__ import annotations

import pytest

from conformance.areas.tp.observation import TpObservation
from conformance.case.spec import CaseSpec, ClassSpec, ModuleSpec, ParamSpec, ShardGroup, TpPlan, WrapPlan
from conformance.run.runner import FAIL, PASS, UNCHECKED, evaluate, observations
from tests.self import faults_tp  # noqa: F401  (registers the fault scenarios in the driver)

pytestmark = pytest.mark.selfcheck

INVARIANTS = ("TP-LAYOUT", "TP-FULL-TENSOR", "TP-PARITY", "TP-STATE-DICT", "TP-MP-DTYPE", "TP-CLIP")
STYLES = (("block.proj", "colwise"), ("block.norm", "sequence"), ("head", "rowwise"), ("embed", "colwise"))


def model(tp: TpPlan, *, frozen_bias: bool = False) -> CaseSpec:
    """root (scale) -> block (w; proj: Linear 8x3, norm: LayerNorm 4), head
    (Linear 3x5: its 5 columns split 3 / 2 over tp, its 3 rows 2 / 1 over
    dp) and embed (Embedding 5x3)."""
    block = ModuleSpec("block", "Block", (ParamSpec("w", (3,)),), children=(
        ModuleSpec("proj", "Linear", (ParamSpec("weight", (8, 3)), ParamSpec("bias", (8,), not frozen_bias))),
        ModuleSpec("norm", "LayerNorm", (ParamSpec("weight", (4,)), ParamSpec("bias", (4,)))),
    ))
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(
        block, ModuleSpec("head", "Linear", (ParamSpec("weight", (3, 5)),)), ModuleSpec("embed", "Embedding", (ParamSpec("weight", (5, 3)),))))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), plan=WrapPlan(api="fsdp2", groups=(ShardGroup(("block",)),)),
                    tp=tp, seed=5)


# clip_all=False throughout: clipping parameters on both meshes together raises
# on this torch (fsdp2-tp-clip-mixed-meshes), which these cases do not test
CASES = {
    "2x2": lambda: model(TpPlan((2, 2), STYLES, clip_all=False)),
    "2x2-adam-frozen-inf": lambda: model(TpPlan((2, 2), STYLES, optimizer="Adam", clip_all=False, norm_type="inf", foreach=True,
                                                 clip_way="get_total_norm"),
                                         frozen_bias=True),
    "2x2-bf16": lambda: model(TpPlan((2, 2), STYLES, clip_all=False, precision="bf16-fp32-reduce")),
}
NOT_APPLICABLE = {("TP-MP-DTYPE", "2x2"), ("TP-MP-DTYPE", "2x2-adam-frozen-inf"), ("TP-PARITY", "2x2-bf16"), ("TP-CLIP", "2x2-bf16")}

FAULTS = [
    ("TP-LAYOUT", "2x2", "colwise-shards-dim-1", "kind:placements"),
    ("TP-LAYOUT", "2x2", "strided-shard-dropped", "kind:placements"),
    ("TP-FULL-TENSOR", "2x2", "strided-shard-dropped", "kind:value"),
    ("TP-PARITY", "2x2", "rowwise-output-not-reduced", "kind:loss"),
    ("TP-STATE-DICT", "2x2", "full-state-dict-load-dropped", "kind:to-flat"),
    ("TP-MP-DTYPE", "2x2-bf16", "param-dtype-ignored", "kind:forward-dtype"),
    ("TP-CLIP", "2x2", "clip-norm-of-local-shards", "kind:norm"),
]


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(4)


def run(invariant: str, spec: CaseSpec, engine, scenario: str = "tp"):
    return evaluate(invariant, spec, observations(engine, spec, scenario, TpObservation.from_dict))


@pytest.mark.gloo
@pytest.mark.parametrize("case", sorted(CASES))
def test_cases_hold_on_unmodified_torch(case, pool):
    spec = CASES[case]()
    obs = observations(pool, spec, "tp", TpObservation.from_dict)
    for invariant in INVARIANTS:
        res = evaluate(invariant, spec, obs)
        want = UNCHECKED if (invariant, case) in NOT_APPLICABLE else PASS
        assert res.verdict == want, res.describe()


@pytest.mark.gloo
@pytest.mark.parametrize("invariant,case,fault,kind", FAULTS, ids=[f"{f[0]}-{f[1]}-{f[2]}" for f in FAULTS])
def test_fault_is_caught_inside_the_ranks(invariant, case, fault, kind, pool):
    res = run(invariant, CASES[case](), pool, f"fault:tp:{fault}")
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


def test_local_shape_is_torch_chunk_of_torch_chunk():
    import torch

    from conformance.areas.tp.oracle import local_shape

    w = torch.empty(5, 3)
    for dp, tp in ((2, 2), (1, 2), (2, 1)):
        for d in range(dp):
            for t in range(tp):
                tp_piece = w.chunk(tp, 0)[t] if t < len(w.chunk(tp, 0)) else w[:0]
                pieces = tp_piece.chunk(dp, 0) if tp_piece.shape[0] else ()
                want = tuple(pieces[d].shape) if d < len(pieces) else (0, 3)
                assert local_shape((5, 3), "Shard(dim=0)", dp, tp, d, t) == want, (dp, tp, d, t)
