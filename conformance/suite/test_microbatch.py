"""MB-COMMS, MB-GRADS, MB-SHARDED: FSDP2's schedule APIs drawn per
microbatch (set_requires_gradient_sync, set_requires_all_reduce,
set_reshard_after_backward, set_is_last_backward, set_reshard_after_forward,
explicit unshard() / reshard(), reshard_after_forward as an int,
shard_placement_fn Shard(1), set_unshard_in_backward(False) on groups whose
parameters backward does not read, an iteration aborted by an exception and
recovered with reset_iter_state()) against the oracle's collectives and the
large batch's gradients; on 2-D (replicate, shard) meshes too (HSDP:
set_requires_all_reduce's accumulation without the replicate all-reduce).
Collectives and placements are structure (the fake tier checks them too);
gradients need real ranks. CPUOffloadPolicy has a test
of its own: it needs an accelerator, and is a SKIP with that reason here.

Spec: the FSDPModule (reset_iter_state included) and fully_shard docstrings
(conformance/areas/microbatch/invariants.py).
"""

import pytest
from hypothesis import given, settings

from conformance.areas.microbatch import AREA
from conformance.case.spec import HSDP_MESHES
from conformance.run import corpus
from conformance.strategies.microbatch import microbatch_specs
from conformance.suite.budget import FAKE_WORLD, examples

MICROBATCH = [inv.id for inv in AREA.invariants]
STRUCTURE = ["MB-COMMS", "MB-SHARDED"]  # what the fake tier can compare


@settings(max_examples=examples(200))
@corpus.examples(*MICROBATCH)
@given(spec=microbatch_specs())
def test_microbatch(spec, engine, conformance):
    conformance.check_example(MICROBATCH, spec, engine, engine.tier)


@settings(max_examples=examples(20))
@given(spec=microbatch_specs(max_modules=4, max_microbatches=2, cpu_offload=True))
def test_microbatch_cpu_offload(spec, engine, conformance):
    conformance.check_example(MICROBATCH, spec, engine, engine.tier)


# HSDP: set_requires_all_reduce's accumulation (reduce-scatter without the
# replicate all-reduce), the all-reduce hook after the all-reduce; every
# mesh of HSDP_MESHES on 2- and 4-rank pools (a 4-rank example shares 2
# cores: a smaller budget), the fake tier's 4 ranks for the structure
@pytest.mark.needs_ranks
@settings(max_examples=examples(30))
@given(spec=microbatch_specs(meshes=HSDP_MESHES))
def test_microbatch_hsdp(spec, worlds, conformance):
    conformance.check_example(MICROBATCH, spec, worlds, worlds.tier)


@settings(max_examples=examples(60))
@given(spec=microbatch_specs(meshes=tuple(m for m in HSDP_MESHES if m[0] * m[1] == FAKE_WORLD)))
def test_microbatch_hsdp_structure(spec, fake_tier, conformance):
    conformance.check_example(STRUCTURE, spec, fake_tier, "fake")
