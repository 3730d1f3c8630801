"""Observation parts several areas share (pure data): a call compared with
the unsharded reference, a parameter's gradient or final value compared
with the reference's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CallObservation:
    index: int
    method: int
    allgathers: int
    close: bool | None  # output equals the reference's (None: the call raised)
    max_diff: float | None
    error: str | None  # "Type: first line" when the call raised
    group_states: tuple[str, ...]  # per observed group after the call: sharded | full | mixed


@dataclass(frozen=True)
class GradObservation:
    fqn: str
    grad_none: bool
    ref_grad_none: bool
    close: bool | None  # gradient equals the reference's (None: either is None)
    max_diff: float | None
    unchanged: bool  # value equals its initial value (frozen: must stay)
