"""FWD-*: user forward methods under FSDP2 (register_fsdp_forward_method) and
FSDP1 (the summon_full_params(recurse=False) workaround).

Spec: spec-sources/004 (register_fsdp_forward_method: pre/post-forward hooks
around the method; a no-op on a module that is not an FSDP module; nested
FSDP submodules run their forward normally; the HF generate() / ViT
forward_features use cases; composer's summon_full_params workaround for
FSDP1) and the register_fsdp_forward_method / fully_shard docstrings.
"""

import pytest
from hypothesis import given, settings

from conformance.run import corpus
from strategies.methods import fsdp2_case_specs, summon_specs
from conformance.suite.budget import examples

FSDP2_METHODS = ["FWD-ALLGATHER", "FWD-PARITY", "FWD-RESHARD", "FWD-NOOP", "FWD-MISSING", "FWD-NESTED", "FWD-ISOLATION"]


@settings(max_examples=examples(100))
@corpus.examples(*FSDP2_METHODS)
@given(spec=fsdp2_case_specs())
def test_fsdp2_forward_methods(spec, engine, conformance):
    """Every example checks each FWD invariant on one run of the case."""
    for invariant_id in FSDP2_METHODS:
        conformance.check(invariant_id, spec, engine, engine.tier)


@pytest.mark.parametrize("invariant_id", ["FWD-SUMMON"])
@settings(max_examples=examples(100))
@corpus.examples("FWD-SUMMON")
@given(spec=summon_specs())
def test_fsdp1_summon_workaround(invariant_id, spec, engine, conformance):
    conformance.check(invariant_id, spec, engine, engine.tier)
