"""What one rank saw of an init_order case (INIT-ORDER, INIT-META,
INIT-SYNC, INIT-DIVERGENT): pure data."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.areas.common.observation import RankRecord


@dataclass(frozen=True)
class ValueCheck:
    """One parameter or buffer (canonical name) against what it must be."""

    name: str
    kind: str  # "param" | "buffer" | "non-persistent-buffer"
    equal: bool
    max_diff: float


@dataclass(frozen=True)
class InitObservation(RankRecord):
    action_error: str | None = None  # an action before the first forward raised ("action: Type: line")
    sync_error: str | None = None  # FSDP1 sync_module_states / FSDP2's broadcast raised
    init_error: str | None = None  # meta-device materialisation (to_empty, reset, param_init_fn) raised
    step_error: str | None = None  # a forward, backward or optimizer step raised on this rank
    failed: bool = False  # some rank raised in the same phase (the ranks agree on it)
    timed_out: bool = False  # this rank's error is a hang on the private group: its timeout, or its StallGuard's close
    # the example made a group of its own (a rank-divergent case): its ranks'
    # process-group state is spent and the pool starts fresh ranks after the
    # example (engine.pool), so that the group is never torn down in a live rank
    spent_process_groups: bool = False
    # model.to(dtype): every parameter is still a DTensor and of the new dtype
    dtype_kept: bool | None = None
    # meta init (FSDP2): parameters whose local shard's shape or placement is
    # not the dim-0 chunk fully_shard promises ("fqn: got vs want")
    bad_shards: tuple[str, ...] = ()
    empty_shard: bool = False  # some parameter's local shard on this rank is empty (its dim 0 < world)
    meta_values: tuple[ValueCheck, ...] = ()  # after materialisation, against the non-meta model
    sync_values: tuple[ValueCheck, ...] = ()  # after sync / broadcast, against rank 0's values
    losses: tuple[float, ...] = ()  # this rank's loss per step
    ref_losses: tuple[float, ...] = ()  # the single-process model's loss of this rank's batch per step
    losses_close: bool | None = None
    final: tuple[ValueCheck, ...] = ()  # full parameters after the steps, against single-process training
    # after the steps, two names of one tied Parameter hold different values:
    # the tie did not survive (meta-device init materialising module by module)
    untied: tuple[str, ...] = ()
    # FSDP1, meta-device init: FSDP manages more elements than the tied
    # model has parameters (the original parameters its flat parameters hold
    # against the model's distinct ones): a tie broke at init, even where the two
    # copies then train alike (a symmetric use keeps their values equal)
    untied_at_init: bool = False
    ref_stable: bool = True  # the reference stayed finite and bounded (else values are not compared)
    skipped_params: tuple[str, ...] = ()  # trainable parameters of the module rank 1 skips
    seconds: float = 0.0
    fsdp_seconds: float = 0.0

    def comparable(self) -> dict:
        """What every rank must agree on: the phases that failed and each
        comparison's verdict (a rank's own error text, shards and losses
        are the invariants'; so are the synced values: FSDP2 leaves each
        rank's non-persistent buffers its own)."""
        d = self.to_dict()
        for k in ("rank", "seconds", "fsdp_seconds", "action_error", "sync_error", "init_error", "step_error", "timed_out", "spent_process_groups",
                  "bad_shards", "empty_shard", "losses", "ref_losses", "losses_close", "sync_values"):
            d.pop(k)
        for key in ("meta_values", "final"):
            for v in d[key]:
                v.pop("max_diff")
        return d
