"""FWD-SUMMON: the FSDP1 workaround for user forward methods, a root method
run inside summon_full_params(recurse=False).

Spec: spec-sources/004 (composer's summon_full_params(self.model,
writeback=False, recurse=False) around generate(); awgu: the workaround for
FullyShardedDataParallel) and the summon_full_params docstring.
"""

from hypothesis import given, settings

from conformance.areas.summon import AREA
from conformance.run import corpus
from conformance.strategies.summon import summon_specs
from conformance.suite.budget import examples

SUMMON = [inv.id for inv in AREA.invariants]


@settings(max_examples=examples(100))
@corpus.examples(*SUMMON)
@given(spec=summon_specs())
def test_summon_workaround(spec, engine, conformance):
    conformance.check_example(SUMMON, spec, engine, engine.tier)
