"""What clipping under either API did with one case on one rank
(CLIP-NORM, CLIP-GRADS): pure data."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.areas.common.observation import GradObservation
from conformance.case.data import Record


@dataclass(frozen=True)
class ClipObservation(Record):
    api: str
    rank: int
    world_size: int
    backend: str
    torch_version: str
    wrap_error: str | None = None
    step_error: str | None = None  # the forward or backward raised
    clip_error: str | None = None  # this rank's clipping call raised
    # under mixed precision: reading FSDP's gradients whole before the clip
    # raised (FSDP1 use_orig_params=True: summon_full_params(with_grads=True))
    gather_error: str | None = None
    # the SGD step after the clip or the read of its full values raised
    # (summon_full_params / full_tensor; the ranks agree on it: CLIP-GRADS)
    read_error: str | None = None
    # this rank did not call the clipping: another rank's local part of it
    # raises before its reduction, which this rank would wait in forever
    peer_failed: bool = False
    failed: bool = False  # some rank's clipping raised (the ranks agree on it)
    norm: float | None = None  # the returned total norm (a DTensor's full value)
    norm_dtensor: bool = False  # returned as a DTensor
    norm_dtype: str | None = None  # the returned norm's dtype ("float32")
    grad_dtypes: tuple[str, ...] = ()  # the dtypes of the gradients clipped, as clipping found them
    ref_norm: float | None = None  # single-process clip_grad_norm_ on the same gradients
    # under mixed precision: the norm of FSDP's own gradients before the
    # clip, gathered whole (what norm_close and the params compare with)
    own_norm: float | None = None
    norm_close: bool | None = None
    # the norm the clipped gradients are scaled by is finite: max_norm / an
    # overflowed norm (inf / inf) gives nothing to compare them with
    scale_finite: bool = True
    max_norm: float | None = None
    clipped: tuple[str, ...] = ()  # canonical FQNs of the trainable parameters clipped
    # this rank's local shard of these clipped gradients is empty (the
    # parameter's dim 0 gives it no rows), where the full gradient is not
    empty_local: tuple[str, ...] = ()
    # after clipping, an SGD step of lr 1 on FSDP's and the reference's
    # model: each parameter's full change is minus its clipped gradient.
    # close: equals the reference's change; unchanged: did not move
    params: tuple[GradObservation, ...] = ()
    frozen_grads_none: tuple[tuple[str, bool], ...] = ()
    seconds: float = 0.0
    fsdp_seconds: float = 0.0  # wrapping, backward, clipping, the step and reading the full values under FSDP (the reference's excluded)

    @property
    def values_meaningful(self) -> bool:
        return self.backend != "fake"

    def comparable(self) -> dict:
        """What every rank must agree on: errors, the agreed failure and the
        verdicts of each comparison (a rank's own error, empty shards and
        local gradients' dtypes are CLIP-NORM's, which reads every rank)."""
        d = self.to_dict()
        for k in ("rank", "seconds", "fsdp_seconds", "clip_error", "peer_failed", "empty_local", "norm", "ref_norm", "own_norm", "max_norm",
                  "grad_dtypes", "gather_error", "read_error"):
            d.pop(k)
        for p in d["params"]:
            p.pop("max_diff")
        return d
