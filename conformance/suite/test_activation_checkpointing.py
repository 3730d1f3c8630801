"""AC-PARITY, AC-STATE-DICT, AC-ALLGATHER: activation checkpointing
(checkpoint_wrapper reentrant and not, torch.utils.checkpoint, selective AC,
the composable checkpoint) on modules inside, around and across FSDP1 units
and FSDP2 groups. State-dict keys and all-gather counts are structure (both
tiers); losses and parameters are values (real ranks).

Spec: the torch.utils.checkpoint, checkpoint_wrapper and
create_selective_checkpoint_contexts docstrings, fully_shard's
reshard_after_forward and the comm oracle
(conformance/areas/activation_checkpointing/invariants.py).
"""

from hypothesis import given, settings

from conformance.areas.activation_checkpointing import AREA
from conformance.run import corpus
from conformance.strategies.activation_checkpointing import ac_specs
from conformance.suite.budget import examples

AC = [inv.id for inv in AREA.invariants]


@settings(max_examples=examples(100))
@corpus.examples(*AC, api="fsdp2")
@given(spec=ac_specs(api="fsdp2"))
def test_activation_checkpointing_fsdp2(spec, engine, conformance):
    conformance.check_example(AC, spec, engine, engine.tier)


@settings(max_examples=examples(100))
@corpus.examples(*AC, api="fsdp1")
@given(spec=ac_specs(api="fsdp1"))
def test_activation_checkpointing_fsdp1(spec, engine, conformance):
    conformance.check_example(AC, spec, engine, engine.tier)
