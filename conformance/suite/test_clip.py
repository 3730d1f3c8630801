"""CLIP-NORM and CLIP-GRADS: gradient clipping over FSDP2's DTensor
gradients (torch.nn.utils.clip_grad_norm_, get_total_norm +
clip_grads_with_norm_) and FSDP1's clip_grad_norm_ method, against
single-process clipping of the same gradients. Values need real
collectives: real ranks only.

Spec: the torch.nn.utils.clip_grad_norm_ / get_total_norm /
clip_grads_with_norm_ docstrings and FullyShardedDataParallel.clip_grad_norm_'s
(conformance/areas/clip/invariants.py).
"""

import pytest
from hypothesis import given, settings

from conformance.areas.clip import AREA
from conformance.areas.common.fsdp2_adapter import takes_ignored_params
from conformance.run import corpus
from conformance.strategies.clip import clip_specs
from conformance.suite.budget import examples

CLIP = [inv.id for inv in AREA.invariants]

pytestmark = pytest.mark.needs_ranks  # values: the fake tier's collectives carry no data


@settings(max_examples=examples(100))
@corpus.examples(*CLIP)
@given(spec=clip_specs(api="fsdp2", allow_ignored=takes_ignored_params()))
def test_clip_fsdp2(spec, engine, conformance):
    conformance.check_example(CLIP, spec, engine, engine.tier)


@settings(max_examples=examples(100))
@given(spec=clip_specs(api="fsdp1"))
def test_clip_fsdp1(spec, engine, conformance):
    conformance.check_example(CLIP, spec, engine, engine.tier)
