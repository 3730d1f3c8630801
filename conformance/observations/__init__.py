"""Observations: what real FSDP did with one case on one rank (pure data that
crosses process boundaries), one module per FSDP API, and training under
either API."""

from conformance.observations.fsdp1 import FROZEN_MARK, FrozenMessage, Observation, UnitObservation
from conformance.observations.fsdp2 import (
    CallObservation,
    FSDP2Observation,
    GradObservation,
    GroupObservation,
    ProbeObservation,
    RegistrationObservation,
)
from conformance.observations.training import TrainObservation

__all__ = [
    "FROZEN_MARK",
    "CallObservation",
    "FSDP2Observation",
    "FrozenMessage",
    "GradObservation",
    "GroupObservation",
    "Observation",
    "ProbeObservation",
    "RegistrationObservation",
    "TrainObservation",
    "UnitObservation",
]
