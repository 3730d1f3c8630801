"""FSDP2 fully_shard applied bottom-up to the plan's groups (FSDP2-*) and user
forward methods registered with register_fsdp_forward_method (FWD-*). Each
example shards its case once, calls it, runs backward, and every invariant
of the area is checked on that one observation.

Spec: the fully_shard docstring (one group per call: module.parameters() less
those assigned by earlier calls on submodules; the list form for modules
that share parameters); DESIGN.md FSDP2-FROZEN; for a parameter two groups
see, the torch release's own check (>= 2.13: ValueError naming it);
spec-sources/004 (register_fsdp_forward_method: pre/post-forward hooks
around the method; a no-op on a module that is not an FSDP module; nested
FSDP submodules run their forward normally; the HF generate() / ViT
forward_features use cases) and the register_fsdp_forward_method docstring.
"""

from hypothesis import given, settings

from conformance.areas.common.fsdp2_adapter import takes_ignored_params
from conformance.areas.fully_shard import AREA
from conformance.run import corpus
from conformance.strategies.groups import fsdp2_case_specs
from conformance.suite.budget import examples

FULLY_SHARD = [inv.id for inv in AREA.invariants]


@settings(max_examples=examples(100))
@corpus.examples(*FULLY_SHARD)
@given(spec=fsdp2_case_specs(methods=False, allow_ignored=takes_ignored_params()))
def test_groups(spec, engine, conformance):
    """Sometimes with ignored_params (where fully_shard takes them), which
    FSDP2-GROUPS requires no group to manage."""
    conformance.check_example(FULLY_SHARD, spec, engine, engine.tier)


@settings(max_examples=examples(100))
@given(spec=fsdp2_case_specs(methods=False, split_ties=True, max_groups=4))
def test_ties_split_between_groups(spec, engine, conformance):
    conformance.check_example(FULLY_SHARD, spec, engine, engine.tier)


@settings(max_examples=examples(100))
@given(spec=fsdp2_case_specs())
def test_forward_methods(spec, engine, conformance):
    conformance.check_example(FULLY_SHARD, spec, engine, engine.tier)
