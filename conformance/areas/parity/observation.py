"""What training under either API did with one case on one rank (PARITY):
pure data."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.areas.common.observation import GradObservation, RankRecord


@dataclass(frozen=True)
class TrainObservation(RankRecord):
    """PARITY: a few optimizer steps against single-process training."""

    step_error: str | None = None
    losses: tuple[float, ...] = ()
    ref_losses: tuple[float, ...] = ()
    losses_close: bool | None = None
    params: tuple[GradObservation, ...] = ()  # close: final value equals the reference's; unchanged: equals the initial
    frozen_grads_none: tuple[tuple[str, bool], ...] = ()
    ref_stable: bool = True  # False: the single-process reference diverged (values not comparable)
    seconds: float = 0.0
    fsdp_seconds: float = 0.0  # wrapping, the FSDP model's steps and reading its full values (the reference's excluded)

    @property
    def values_meaningful(self) -> bool:
        return self.backend != "fake" and self.ref_stable


    def comparable(self) -> dict:
        d = self.to_dict()
        for k in ("rank", "seconds", "fsdp_seconds", "losses", "ref_losses"):
            d.pop(k)
        for p in d["params"]:
            p.pop("max_diff")
        return d
