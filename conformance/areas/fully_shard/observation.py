"""What FSDP2 (and the FSDP1 forward-method workaround, which reports in the
same shape) did with one case on one rank: pure data."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.areas.common.observation import CallObservation, GradObservation, RankRecord


@dataclass(frozen=True)
class GroupObservation:
    modules: tuple[str, ...]  # canonical paths of the modules sharing the group's state
    managed: tuple[str, ...]  # canonical FQNs of its FSDPParams


@dataclass(frozen=True)
class RegistrationObservation:
    method: int
    fsdp_module: bool  # isinstance(module, FSDPModule)
    patched: bool  # the method is now an attribute of the instance
    others_unchanged: bool  # no other instance (same class in the model, the reference model) changed
    error: str | None = None  # registration raised


@dataclass(frozen=True)
class ProbeObservation:
    call: int
    step: int  # -1: on entry
    fqn: str  # canonical
    state: str  # "full" | "sharded" | "other" (a plain tensor of the wrong shape)
    equal: bool | None  # full: equal to the reference's value


@dataclass(frozen=True)
class FSDP2Observation(RankRecord):
    groups: tuple[GroupObservation, ...] = ()
    registrations: tuple[RegistrationObservation, ...] = ()
    missing: tuple[tuple[str, bool, str | None], ...] = ()  # (module, fsdp_module, error type of a missing name)
    calls: tuple[CallObservation, ...] = ()
    probes: tuple[ProbeObservation, ...] = ()
    backward_error: str | None = None
    backward_ran: bool = False
    read_error: str | None = None  # reading the full values and gradients after backward raised
    grads: tuple[GradObservation, ...] = ()
    ties_intact: tuple[tuple[str, bool], ...] = ()  # canonical FQN -> aliases one tensor (after the calls)
    warnings: tuple[str, ...] = ()  # UserWarnings while sharding and registering
    seconds: float = 0.0  # FSDP's work: fully_shard, registration, the calls (under the suite's collective counting), the full values' read
    backward_seconds: float = 0.0  # the sharded model's backward (FSDP's hooks and reduce-scatters)


    def comparable(self) -> dict:
        """What every rank must agree on (rank, timings and float noise removed)."""
        d = self.to_dict()
        for k in ("rank", "seconds", "backward_seconds", "warnings", "read_error"):  # a rank's own error text; the read is a collective
            d.pop(k)
        for c in d["calls"]:
            c.pop("max_diff")
        for gr in d["grads"]:
            gr.pop("max_diff")
        return d
