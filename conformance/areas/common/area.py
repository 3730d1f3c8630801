"""The record each area registers itself with (conformance.areas.AREAS):
its invariants, its scenarios (what a rank does with a case and how the
driver reads it), its repro generator and its bench."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from conformance.areas.common.catalog import Invariant
from conformance.areas.common.ranks import ranks_agree


@dataclass(frozen=True)
class AreaScenario:
    """One thing a rank does with a case for an area: ``run(case, **args)``
    returns a JSON-able dict, which ``observation.from_dict`` reads back in
    the driver; ``predict(case)`` is the oracle's side. ``ranks_tags(case,
    prediction, observations)``: the facts a rank disagreement is tagged
    with; ``failure_tags(case, prediction, world_size)``: those of a HANG or
    CRASH on a pool of ``world_size`` ranks, which a known failure may then describe (None: such an example is
    always a failure). ``phases``: a scenario run as several scenarios one
    after the other in one directory (a checkpoint's save and load)."""

    name: str
    run: Callable[..., dict] | None
    observation: type
    predict: Callable[[Any], Any]
    ranks_tags: Callable[[Any, Any, list], set[str]] | None = None
    failure_tags: Callable[[Any, Any, int], set[str]] | None = None
    phases: tuple[str, ...] = ()
    # how the ranks' agreement is checked; None: every rank's comparable()
    # equal (conformance.areas.common.ranks.ranks_agree, with ranks_tags)
    agree: Callable[[Any, Any, list], list] | None = None
    # the scenarios whose observations this one's include (it serves their
    # invariants on the same run)
    covers: tuple[str, ...] = ()
    # an observation's time inside FSDP (the bench's measure), or None
    fsdp_seconds: Callable[[Any], float] | None = None

    def comparable(self, value: dict) -> Any:
        """What every rank must agree on, from one rank's value."""
        return self.observation.from_dict(value).comparable()

    def ranks_disagree(self, case, prediction, observations: list) -> list:
        """RANKS-AGREE violations of one example (none on one rank)."""
        if len(observations) < 2:
            return []
        if self.agree is not None:
            return self.agree(case, prediction, observations)
        tags = self.ranks_tags(case, prediction, observations) if self.ranks_tags else set()
        return ranks_agree(observations, tags)


@dataclass(frozen=True)
class Area:
    """One area: a thing FSDP does or is composed with, checked end to end.

    ``applies(case)``: whether a case is one of this area's (a checkpoint
    case has a checkpoint plan, ...); ``unavailable(case)``: why the
    installed torch cannot run it here (a SKIP), or None; ``repro(case,
    violation_lines, title)``: its standalone script; ``model_cases``: ""
    when real models (ModelCase) are checked too, else why not. The suite module is
    conformance/suite/test_<name>.py."""

    name: str
    title: str
    invariants: tuple[Invariant, ...]
    scenarios: tuple[AreaScenario, ...]
    applies: Callable[[Any], bool]
    repro: Callable[..., str]
    unavailable: Callable[[Any], str | None] | None = None
    model_cases: str = ""
    # every invariant compares values or world sizes: not run on the fake
    # tier (its collectives carry no data)
    needs_ranks: bool = False

    def __post_init__(self) -> None:
        names = {s.name for s in self.scenarios} | {p for s in self.scenarios for p in s.phases}
        for inv in self.invariants:
            if inv.scenario not in names:
                raise ValueError(f"area {self.name}: invariant {inv.id} names scenario {inv.scenario!r}, not one of {sorted(names)}")
        object.__setattr__(self, "invariants", tuple(dataclasses.replace(i, area=self.name) for i in self.invariants))

    @property
    def suite_module(self) -> str:
        return f"test_{self.name}"

    def scenario(self, name: str) -> AreaScenario:
        return next(s for s in self.scenarios if s.name == name)
