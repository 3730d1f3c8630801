"""The microbatch oracle: what FSDP2 communicates in each microbatch under
the schedule settings drawn for it (conformance.areas.common.comm_oracle,
with set_requires_gradient_sync, set_reshard_after_backward,
set_is_last_backward, set_reshard_after_forward and explicit unshard() /
reshard() as its docstrings state them; set_requires_all_reduce governs
HSDP's all-reduce only, of which a 1-D mesh has none), and which gradients
the microbatches accumulate: the large batch's, the mean over ranks summed
over microbatches (set_requires_gradient_sync: "gradient accumulation
*without communication*")."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from conformance.areas.common.comm_oracle import Expected, FSDP2Comm, Knobs, simulate_fsdp2
from conformance.case.graph import ModelGraph
from conformance.case.spec import CaseSpec


@dataclass(frozen=True)
class MicrobatchPrediction:
    spec: CaseSpec
    trainable: tuple[str, ...]  # canonical FQNs: each ends with the large batch's gradient
    frozen: tuple[str, ...]  # each ends with no gradient

    def expect(self, world: int) -> Expected:
        return _expect(self.spec, world)


def knobs(spec: CaseSpec) -> tuple[Knobs, ...]:
    return tuple(Knobs(s.sync, s.reshard_after_backward, s.is_last_backward, s.reshard_after_forward, s.unshard, s.reshard)
                 for s in spec.microbatch.microbatches)


@functools.lru_cache(maxsize=512)
def _expect(spec: CaseSpec, world: int) -> Expected:
    return simulate_fsdp2(spec, world, FSDP2Comm(knobs(spec), shard_dim1=spec.microbatch.shard_dim1))


@functools.lru_cache(maxsize=512)
def predict_microbatch(spec: CaseSpec) -> MicrobatchPrediction:
    g = ModelGraph(spec)
    return MicrobatchPrediction(
        spec,
        tuple(f for f, pid in g.named_parameters() if g.requires_grad(pid)),
        tuple(f for f, pid in g.named_parameters() if not g.requires_grad(pid)),
    )
