"""What one rank saw over one step's microbatches (pure data): each
microbatch's collectives and events, the accumulated gradients against the
large batch's, and whether parameters and gradients are sharded DTensors
after the last backward."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.areas.common.comm_observation import IterationSeen
from conformance.case.data import Record


@dataclass(frozen=True)
class GradSeen:
    fqn: str
    none: bool  # FSDP left no gradient
    ref_none: bool  # the large batch's reference has none
    err: float  # max |g - ref| / (1 + max |ref|) (0 when both are None; -1: not compared)


@dataclass(frozen=True)
class ShardSeen:
    fqn: str
    sharded: bool  # the module's registered parameter is a DTensor with Shard placements
    grad_sharded: bool | None  # its gradient is one too (None: no gradient)


@dataclass(frozen=True)
class HookSeen:
    fqn: str
    calls: int  # the parameter's post-accumulate-grad hook ran this often over the sequence
    has_grad: bool  # the parameter ends the sequence with a gradient
    last_is_final: bool | None  # the .grad its last call saw is the final one (None: no call, or no final gradient)


@dataclass(frozen=True)
class MicrobatchObservation(Record):
    api: str
    rank: int
    world_size: int
    backend: str
    torch_version: str
    error: str | None = None
    iterations: tuple[IterationSeen, ...] = ()
    grads: tuple[GradSeen, ...] = ()
    shards: tuple[ShardSeen, ...] = ()
    hooks: tuple[HookSeen, ...] = ()  # MicrobatchPlan.grad_hooks
    read_error: str | None = None  # reading the parameters or the gradients' full values after the last microbatch raised
    seconds: float = 0.0

    @property
    def values_meaningful(self) -> bool:
        return self.backend != "fake"

    def comparable(self) -> dict:
        d = self.to_dict()
        for k in ("rank", "seconds", "grads", "hooks", "read_error"):
            d.pop(k)
        return d
