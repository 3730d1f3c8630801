"""HSDP-PARITY, HSDP-REPLICAS, HSDP-DEGENERATE, HSDP-LAYOUT,
HSDP-STATE-DICT, HSDP-COMMS: FSDP2 over a 2-D (replicate, shard) mesh and
FSDP1's HYBRID_SHARD / _HYBRID_SHARD_ZERO2 (a device_mesh or a
process-group pair), trained on data that differs by rank, against
single-process training, flat FSDP over the whole world and the oracle.
A 2-D mesh needs 4 ranks: those cases run on a 4-rank pool made for this
module, the (2, 1) and (1, 2) ones on the session's pool. Layout and
collectives need no values: the fake tier (4 ranks) checks them too.

Spec: the fully_shard, FullyShardedDataParallel and ShardingStrategy
docstrings, upstream's test_fully_shard_training.py
(TestFullyShardHSDPTraining) and test_fsdp_hybrid_shard.py
(conformance/areas/hsdp/invariants.py).
"""

import pytest
import torch
from hypothesis import given, settings

from conformance.areas.hsdp import AREA
from conformance.strategies.hsdp import hsdp_specs
from conformance.suite.budget import FAKE_WORLD, examples

HSDP = [inv.id for inv in AREA.invariants]
STRUCTURE = ["HSDP-LAYOUT", "HSDP-COMMS", "HSDP-DEGENERATE"]  # what the fake tier can compare
# examples(35) per value test: each is three models trained on up to 4 ranks
# sharing 2 cores (about 0.7 s an example); the module stays near a minute
# under the ci profile


def _check(spec, worlds, conformance):
    if worlds.backend == "nccl" and torch.cuda.device_count() < spec.hsdp.world:
        pytest.skip(f"nccl: a mesh of {spec.hsdp.world} ranks needs as many GPUs, this machine has {torch.cuda.device_count()}")
    conformance.check_example(HSDP, spec, worlds, worlds.tier)


@pytest.mark.needs_ranks
@settings(max_examples=examples(35))
@given(spec=hsdp_specs(api="fsdp2"))
def test_hsdp_fsdp2(spec, worlds, conformance):
    _check(spec, worlds, conformance)


@pytest.mark.needs_ranks
@settings(max_examples=examples(35))
@given(spec=hsdp_specs(api="fsdp1"))
def test_hsdp_fsdp1(spec, worlds, conformance):
    _check(spec, worlds, conformance)


@settings(max_examples=examples(60))
@given(spec=hsdp_specs(api="fsdp2", worlds=(FAKE_WORLD,)))
def test_hsdp_structure_fsdp2(spec, fake_tier, conformance):
    conformance.check_example(STRUCTURE, spec, fake_tier, "fake")


@settings(max_examples=examples(60))
@given(spec=hsdp_specs(api="fsdp1", worlds=(FAKE_WORLD,)))
def test_hsdp_structure_fsdp1(spec, fake_tier, conformance):
    conformance.check_example(STRUCTURE, spec, fake_tier, "fake")
