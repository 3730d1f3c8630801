"""FSDP2-*: fully_shard applied bottom-up to the plan's groups.

Spec: the fully_shard docstring (one group per call: module.parameters() less
those assigned by earlier calls on submodules; the list form for modules that
share parameters); DESIGN.md FSDP2-FROZEN; for a parameter two groups see,
the torch release's own check (>= 2.13: ValueError naming it).
"""

import pytest
from hypothesis import given, settings

from conformance.run import corpus
from conformance.areas.common.fsdp2_adapter import takes_ignored_params
from strategies.methods import fsdp2_case_specs
from conformance.suite.budget import examples

STRUCTURE = ["FSDP2-GROUPS", "FSDP2-FROZEN", "FSDP2-TIES"]


@settings(max_examples=examples(100))
@corpus.examples(*STRUCTURE)
@given(spec=fsdp2_case_specs(methods=False, allow_ignored=takes_ignored_params()))
def test_groups_frozen_ties(spec, engine, conformance):
    """Every example checks the three invariants on one run of the case;
    sometimes with ignored_params (where fully_shard takes them), which
    FSDP2-GROUPS requires no group to manage."""
    for invariant_id in STRUCTURE:
        conformance.check(invariant_id, spec, engine, engine.tier)


@pytest.mark.parametrize("invariant_id", ["FSDP2-TIES"])
@settings(max_examples=examples(100))
@corpus.examples("FSDP2-TIES")
@given(spec=fsdp2_case_specs(methods=False, split_ties=True, max_groups=4))
def test_ties_split_between_groups(invariant_id, spec, engine, conformance):
    conformance.check(invariant_id, spec, engine, engine.tier)
