"""The comm area's oracle: the plan's iterations under FSDP2 or FSDP1, each
iteration's collectives per group or unit and FSDP2's events, from
conformance.areas.common.comm_oracle (which states the promises and where
they are documented)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from conformance.areas.common.comm_oracle import Expected, FSDP2Comm, Knobs, simulate_fsdp1, simulate_fsdp2
from conformance.case.spec import CaseSpec


@dataclass(frozen=True)
class CommPrediction:
    spec: CaseSpec

    def expect(self, world: int) -> Expected:
        return _expect(self.spec, world)


def predict_comm(spec: CaseSpec) -> CommPrediction:
    return CommPrediction(spec)


@functools.lru_cache(maxsize=512)
def _expect(spec: CaseSpec, world: int) -> Expected:
    c = spec.comm
    if spec.plan.api == "fsdp2":
        return simulate_fsdp2(spec, world, FSDP2Comm((Knobs(),) * c.iterations, c.param_dtype, c.reduce_dtype,
                                                     c.forward_prefetch, c.backward_prefetch))
    return simulate_fsdp1(spec, world, c)
