"""What FSDP1 auto-wrapping did with one case on one rank (pure data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conformance.case.data import Record

# The phrase torch's frozen-parameter error and warning start with.
FROZEN_MARK = "has both parameters with requires_grad=True and False"


@dataclass(frozen=True)
class FrozenMessage:
    """A frozen-parameter ValueError or UserWarning, parsed. Names are
    canonical (the first name the unwrapped model gives that module or
    parameter); a name that is no alias of anything is kept as written."""

    category: str  # "ValueError" | "UserWarning"
    text: str
    module: str | None  # None when the text names no module
    total_numel: int | None
    trainable_numel: int | None
    trainable: tuple[str, ...] | None  # None when the text lists no FQNs
    frozen: tuple[str, ...] | None


@dataclass(frozen=True)
class UnitObservation:
    path: str  # canonical path of the wrapped module ("" for the root)
    managed: tuple[str, ...]  # canonical FQNs in the unit's flat parameter
    raw_managed: tuple[str, ...]  # as FSDP names them, prefixed with the unit path
    simulated: tuple[str, ...] | None  # torch's pre-wrap simulation, canonical
    # the unit's construction kwargs a CustomPolicy may override (spec.CUSTOM_KWARGS), as (key, value)
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class WrapObservation(Record):
    api: str
    rank: int
    world_size: int
    torch_version: str
    units: tuple[UnitObservation, ...] = ()  # in the order FSDP created them
    error: FrozenMessage | None = None  # wrap raised (category = exception type)
    warnings: tuple[FrozenMessage, ...] = ()  # frozen-parameter warnings, in order
    other_warnings: tuple[str, ...] = ()
    state_dict_keys: tuple[str, ...] = ()
    state_dict_error: str | None = None  # state_dict() raised after a good wrap
    named_parameters: tuple[str, ...] = ()  # use_orig_params=True only
    # tie survival: for each tie group (canonical FQN), whether every alias
    # still resolves to one tensor after wrapping (use_orig_params=True)
    ties_intact: tuple[tuple[str, bool], ...] = ()
    wrap_seconds: float = 0.0  # time inside FSDP's constructor
    state_dict_seconds: float = 0.0  # time inside FSDP's state_dict()
    extra: tuple[tuple[str, Any], ...] = ()  # API-specific facts


    def comparable(self) -> dict:
        """What every rank must agree on (rank and timing removed)."""
        d = self.to_dict()
        # other_warnings: torch's unrelated warnings, informational only
        for k in ("rank", "wrap_seconds", "state_dict_seconds", "other_warnings"):
            d.pop(k)
        return d
