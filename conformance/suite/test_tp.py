"""TP-LAYOUT, TP-FULL-TENSOR, TP-PARITY, TP-STATE-DICT, TP-MP-DTYPE, TP-CLIP:
tensor parallelism (parallelize_module over the "tp" dim of a (dp, tp)
DeviceMesh: ColwiseParallel / RowwiseParallel on Linear and Embedding
leaves, SequenceParallel on LayerNorm ones) composed with FSDP2
(fully_shard(mesh=mesh["dp"])), trained on data that differs by dp rank
against single-process training, clipped with clip_grad_norm_, its state
dicts carried to flat FSDP and back. A 2-D mesh needs 4 ranks: those cases
run on a 4-rank pool made for this module, the (1, 2) and (2, 1) ones on
the session's pool. Layout needs no values: the fake tier (4 ranks) checks
it too.

Spec: the torch.distributed.tensor.parallel style docstrings, fully_shard's,
DTensor.full_tensor's, torch.distributed.checkpoint.state_dict's,
MixedPrecisionPolicy's and clip_grad_norm_'s; upstream
test_fully_shard_training.py (TestFullyShard2DTraining),
test_fully_shard_state_dict.py (2D), test_tp_style.py, test_parallelize_api.py
(conformance/areas/tp/invariants.py).
"""

import pytest
import torch
from hypothesis import given, settings

from conformance.areas.tp import AREA
from conformance.strategies.tp import tp_specs
from conformance.suite.budget import FAKE_WORLD, examples

TP = [inv.id for inv in AREA.invariants]
STRUCTURE = ["TP-LAYOUT"]  # what the fake tier can compare
# examples(8) for the value test: each is four models (2-D, reference, two
# flat FSDP ones) on up to 4 ranks sharing 2 cores


@pytest.fixture(scope="module")
def tp_worlds(worlds, request):
    # an example takes a few seconds; a hung one (fsdp2-tp-empty-piece-full-tensor-hang)
    # should not cost the base pool's minute: a quarter of the example
    # deadline (15 s at the default 60 s). A fixed 15 s made slow examples
    # HANGs on a loaded machine whatever --example-deadline said (the release
    # matrix, 2.13.0 gloo-w2, run beside the test suite: 4 ranks on 2 cores).
    return worlds.view(deadline=request.config.getoption("--example-deadline") / 4)


@pytest.mark.needs_ranks
@settings(max_examples=examples(8))
@given(spec=tp_specs())
def test_tp(spec, tp_worlds, conformance):
    if tp_worlds.backend == "nccl" and torch.cuda.device_count() < spec.tp.world:
        pytest.skip(f"nccl: a mesh of {spec.tp.world} ranks needs as many GPUs, this machine has {torch.cuda.device_count()}")
    conformance.check_example(TP, spec, tp_worlds, tp_worlds.tier)


@settings(max_examples=examples(30))
@given(spec=tp_specs(worlds=(FAKE_WORLD,)))
def test_tp_structure(spec, fake_tier, conformance):
    conformance.check_example(STRUCTURE, spec, fake_tier, "fake")
