"""What the FSDP1 forward-method workaround did on one rank (pure data)."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.areas.common.observation import CallObservation
from conformance.case.data import Record


@dataclass(frozen=True)
class SummonObservation(Record):
    api: str
    rank: int
    world_size: int
    backend: str
    torch_version: str
    wrap_error: str | None = None
    calls: tuple[CallObservation, ...] = ()  # each root forward or method call against the unwrapped reference
    seconds: float = 0.0

    @property
    def values_meaningful(self) -> bool:
        """The fake process group's collectives move no data: values are noise."""
        return self.backend != "fake"

    def comparable(self) -> dict:
        """What every rank must agree on (rank, timing and float noise removed)."""
        d = self.to_dict()
        for k in ("rank", "seconds"):
            d.pop(k)
        for c in d["calls"]:
            c.pop("max_diff")
        return d
