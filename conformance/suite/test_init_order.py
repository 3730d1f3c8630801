"""INIT-ORDER, INIT-META, INIT-SYNC and INIT-DIVERGENT: when the user's
actions happen around FSDP's lazy initialisation (the optimizer before or
after the first forward, state dicts and unshard() before it, to(dtype)
after fully_shard), meta-device init, rank-seeded models synchronised from
rank 0, and a module one rank does not call, under FSDP1 and FSDP2, against
single-process training. Values need real collectives: real ranks only.

Spec: the fully_shard, FSDPModule.unshard, FullyShardedDataParallel
(sync_module_states, param_init_fn) and set_model_state_dict docstrings
(conformance/areas/init_order/invariants.py).
"""

import pytest
from hypothesis import given, settings

from conformance.areas.init_order import AREA
from conformance.run import corpus
from conformance.strategies.init_order import init_specs
from conformance.suite.budget import examples

INIT = [inv.id for inv in AREA.invariants]
ORDER = [i for i in INIT if i != "INIT-DIVERGENT"]  # every rank calls every module
DIVERGENT = ["INIT-DIVERGENT"]  # the others compare nothing there; a rank killed by torch is this one's

# The order cases run on the fake tier too: the structure there (meta-init
# shards and placements, the dtype after to(), what raises) is checked, the
# values only on real ranks. The rank-divergent ones need real ranks (a
# collective one rank misses is the point).


@settings(max_examples=examples(15))
@corpus.examples(*ORDER)
@given(spec=init_specs(api="fsdp2"))
def test_init_order_fsdp2(spec, engine, conformance):
    conformance.check_example(ORDER, spec, engine, engine.tier)


@settings(max_examples=examples(10))
@given(spec=init_specs(api="fsdp1"))
def test_init_order_fsdp1(spec, engine, conformance):
    conformance.check_example(ORDER, spec, engine, engine.tier)


# a rank-divergent example that hangs costs about a second (its StallGuard)
# and fresh ranks, one that kills a rank a pool restart: few examples
@pytest.mark.needs_ranks
@settings(max_examples=examples(3))
@given(spec=init_specs(api="fsdp2", kind="divergent"))
def test_init_divergent_fsdp2(spec, engine, conformance):
    conformance.check_example(DIVERGENT, spec, engine, engine.tier)


@pytest.mark.needs_ranks
@settings(max_examples=examples(3))
@corpus.examples(*DIVERGENT)
@given(spec=init_specs(api="fsdp1", kind="divergent"))
def test_init_divergent_fsdp1(spec, engine, conformance):
    conformance.check_example(DIVERGENT, spec, engine, engine.tier)
