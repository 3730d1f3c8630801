"""What the FSDP1 forward-method workaround did on one rank (pure data)."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.areas.common.observation import CallObservation, RankRecord


@dataclass(frozen=True)
class SummonObservation(RankRecord):
    calls: tuple[CallObservation, ...] = ()  # each root forward or method call against the unwrapped reference
    seconds: float = 0.0  # wrapping and the calls under FSDP (the reference's calls excluded)

    def comparable(self) -> dict:
        """What every rank must agree on (rank, timing and float noise removed)."""
        d = self.to_dict()
        for k in ("rank", "seconds"):
            d.pop(k)
        for c in d["calls"]:
            c.pop("max_diff")
        return d
