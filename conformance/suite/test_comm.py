"""COMM-COUNTS, COMM-ORDER, COMM-FSDP1-COUNTS, COMM-FSDP1-PREFETCH: what
FSDP communicates in each iteration, collective by collective (count,
numel, ranks, dtype), FSDP2's unshard / reshard / post-backward order and
FSDP1's prefetching, under either API. Counts and sizes need no values:
the fake tier checks them too (cheaply), the gloo tier on real ranks.

Spec: the fully_shard, set_modules_to_*_prefetch, MixedPrecisionPolicy,
FullyShardedDataParallel and BackwardPrefetch docstrings, and upstream's
test_fully_shard_comm.py (conformance/areas/comm/invariants.py).
"""

from hypothesis import given, settings

from conformance.areas.comm import AREA
from conformance.run import corpus
from conformance.strategies.comm import comm_specs
from conformance.suite.budget import examples

FSDP2 = [inv.id for inv in AREA.invariants if "fsdp2" in inv.apis]
FSDP1 = [inv.id for inv in AREA.invariants if "fsdp1" in inv.apis]


@settings(max_examples=examples(200))
@corpus.examples(*FSDP2)
@given(spec=comm_specs(api="fsdp2"))
def test_comm_fsdp2(spec, engine, conformance):
    conformance.check_example(FSDP2, spec, engine, engine.tier)


@settings(max_examples=examples(200))
@corpus.examples(*FSDP1)
@given(spec=comm_specs(api="fsdp1"))
def test_comm_fsdp1(spec, engine, conformance):
    conformance.check_example(FSDP1, spec, engine, engine.tier)
