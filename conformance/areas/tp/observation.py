"""What tensor parallelism + FSDP2 did with one case on one rank (TP-*): pure data."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.areas.common.observation import RankRecord


@dataclass(frozen=True)
class LayoutSeen:
    """One parameter after parallelize_module and fully_shard, as this rank
    holds it: its DTensor placements (str of the tuple; "" for a plain
    tensor), its mesh's shape, its local shard's shape, and whether the
    local shard equals the oracle's slice of the unsharded parameter
    (None on the fake tier, or where the shapes already differ)."""

    fqn: str
    placements: str
    mesh: tuple[int, ...]
    local_shape: tuple[int, ...]
    local_equal: bool | None = None


@dataclass(frozen=True)
class ValueSeen:
    """A full value (a parameter, a gradient) against the reference's."""

    fqn: str
    close: bool
    max_diff: float


@dataclass(frozen=True)
class TpObservation(RankRecord):
    mesh: tuple[int, ...] = ()
    layout: tuple[LayoutSeen, ...] = ()
    requires_grad_changed: tuple[str, ...] = ()  # parameters whose requires_grad wrapping changed
    # TP-FULL-TENSOR: full_tensor() of each parameter right after wrapping,
    # bitwise equal to the unsharded model's (fqn, equal)
    full_equal: tuple[tuple[str, bool], ...] = ()
    step_error: str | None = None
    losses: tuple[float, ...] = ()
    ref_losses: tuple[float, ...] = ()
    losses_close: bool | None = None
    ref_stable: bool = True
    vs_reference: tuple[ValueSeen, ...] = ()
    # TP-MP-DTYPE: what a forward pre-hook of each module sees of its own
    # parameters' local tensors ((fqn, dtype)), and after the backward the
    # sharded parameters' and their gradients' dtypes
    forward_dtypes: tuple[tuple[str, str], ...] = ()
    sharded_dtypes: tuple[tuple[str, str], ...] = ()
    grad_dtypes: tuple[tuple[str, str], ...] = ()
    # TP-CLIP
    clip_error: str | None = None  # this rank's clip raised
    clip_peer_failed: bool = False  # this rank did not call it: another's local part raises before the reduction
    clip_failed: bool = False  # some rank's clip raised (the ranks agree on it)
    norm: float | None = None
    ref_norm: float | None = None
    norm_close: bool | None = None
    scale_finite: bool = True  # the reference norm is finite: max_norm / inf (inf / inf) scales nothing comparable
    clipped_grads: tuple[ValueSeen, ...] = ()
    clip_meshes: tuple[tuple[int, ...], ...] = ()  # the meshes of the clipped gradients, each once
    tp_empty: tuple[str, ...] = ()  # parameters whose TP-local tensor is empty on this rank
    # TP-STATE-DICT: full state dict of the trained 2-D model against its
    # parameters; loaded into flat (1-D, no TP) FSDP and back; a sharded
    # DCP save loaded into flat FSDP: the keys whose values differ
    sd_errors: tuple[tuple[str, str], ...] = ()  # (round trip, what it raised)
    sd_keys: tuple[str, ...] = ()
    unsharded_keys: tuple[str, ...] = ()
    sd_vs_params: tuple[str, ...] = ()
    sd_to_flat_differs: tuple[str, ...] = ()
    sd_from_flat_differs: tuple[str, ...] = ()
    dcp_to_flat_differs: tuple[str, ...] = ()
    seconds: float = 0.0
    fsdp_seconds: float = 0.0

    def comparable(self) -> dict:
        """What every rank must agree on: errors, keys, full-value verdicts
        (local shards, losses and what a clip raised on one rank differ
        by rank by design; TP-CLIP and TP-LAYOUT read every rank)."""
        d = self.to_dict()
        for k in ("rank", "seconds", "fsdp_seconds", "layout", "losses", "ref_losses", "losses_close", "clip_error", "clip_peer_failed",
                  "norm", "ref_norm", "norm_close", "tp_empty", "step_error", "forward_dtypes", "sharded_dtypes", "grad_dtypes"):
            d.pop(k)
        for key in ("vs_reference", "clipped_grads"):
            for p in d[key]:
                p.pop("max_diff")
        return d
