"""Observation parts several areas share (pure data): a call compared with
the unsharded reference, a parameter's gradient or final value compared
with the reference's; the fields every rank's observation starts with."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.case.data import Record


@dataclass(frozen=True)
class CallObservation:
    index: int
    method: int
    allgathers: int
    close: bool | None  # output equals the reference's (None: the call raised, or the fake tier compared nothing)
    max_diff: float | None
    error: str | None  # "Type: first line" when the call raised
    group_states: tuple[str, ...]  # per observed group after the call: sharded | full | mixed
    # a method's own module's forward ran inside it this many times (it calls
    # self(...)), and so many ops read a sharded parameter after such a
    # nested forward (FSDP2; conformance.areas.common.fsdp2_adapter.watch_method)
    nested_forwards: int = 0
    sharded_reads: int = 0


@dataclass(frozen=True)
class GradObservation:
    fqn: str
    grad_none: bool
    ref_grad_none: bool
    close: bool | None  # gradient equals the reference's (None: either is None)
    max_diff: float | None
    unchanged: bool  # value equals its initial value (frozen: must stay)


@dataclass(frozen=True)
class RankRecord(Record):
    """What every area's observation of one rank starts with: which API, on
    which rank of how many, over which backend and torch, and whether
    wrapping raised."""

    api: str
    rank: int
    world_size: int
    backend: str
    torch_version: str
    wrap_error: str | None = None

    @property
    def values_meaningful(self) -> bool:
        """The fake process group's collectives move no data: values are noise."""
        return self.backend != "fake"
