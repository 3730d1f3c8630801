"""What a rank saw FSDP communicate, iteration by iteration (pure data; the
comm and microbatch areas' observations hold it)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass


@dataclass(frozen=True)
class CollectiveSeen:
    """A collective as the dispatcher saw it: the unsharded side's numel, the
    ranks it spans (unsharded / local numel), its dtype, the group or unit
    that issued it and (FSDP1) the hook it ran in; ``via``: FSDP2, the
    suite's custom comm it went through ("custom G": the custom comms given
    to group G; "" for FSDP's own). An all-reduce hook's call is not a
    ``via`` but a record of its own (op "all_reduce_hook", the numel of the
    tensor it was given, ranks 1)."""

    phase: str
    op: str
    group: str
    numel: int
    ranks: int
    dtype: str
    context: str = ""
    _: KW_ONLY
    via: str = ""
    # FSDP2 reduce-scatters, where the recorder is told the mesh's shard
    # group: "" for it, "separate N" for the N-th other process group seen
    pg: str = ""


@dataclass(frozen=True)
class EventSeen:
    kind: str  # unshard | reshard | post_backward
    group: str
    state: str  # the group's training state: FORWARD | PRE_BACKWARD | POST_BACKWARD


@dataclass(frozen=True)
class IterationSeen:
    collectives: tuple[CollectiveSeen, ...] = ()
    events: tuple[EventSeen, ...] = ()
    backward: bool = True
