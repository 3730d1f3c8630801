"""What one rank saw FSDP communicate, iteration by iteration (pure data)."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.areas.common.comm_observation import IterationSeen
from conformance.case.data import Record


@dataclass(frozen=True)
class CommObservation(Record):
    api: str
    rank: int
    world_size: int  # the ranks FSDP shards over (1: this rank alone)
    backend: str
    torch_version: str
    error: str | None = None
    iterations: tuple[IterationSeen, ...] = ()
    seconds: float = 0.0

    def comparable(self) -> dict:
        d = self.to_dict()
        for k in ("rank", "seconds"):
            d.pop(k)
        return d
