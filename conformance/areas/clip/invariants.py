"""CLIP-NORM and CLIP-GRADS: gradient clipping over FSDP1's and FSDP2's
sharded gradients against single-process clipping."""

from __future__ import annotations

from conformance.areas.clip.observation import ClipObservation
from conformance.areas.clip.oracle import ClipPrediction
from conformance.areas.common.catalog import VALUES_UNCHECKED, Catalog, NotChecked
from conformance.areas.common.violations import backend_tag, violation
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation

catalog = Catalog()

DOC_CLIP = ("torch.nn.utils.clip_grad_norm_ / get_total_norm docstrings (the norm over all gradients as if concatenated "
            "into one vector; gradients modified in place); FullyShardedDataParallel.clip_grad_norm_ docstring "
            "(handles gradients sharded across ranks; call on every rank; the norm in the 'largest' dtype across all "
            "parameters/gradients); MixedPrecisionPolicy / MixedPrecision docstrings (bf16 compute and reduction)")


def error_tag(text: str) -> str:
    """The mechanism of a clipping error, for findings to match on."""
    if "norm on an empty tensor" in text:
        return "error:inf-norm-empty"
    if "mixed torch.Tensor and DTensor" in text:
        return "error:mixed-tensor-dtensor"
    if "out of bounds for storage of size 0" in text:
        return "error:freed-storage"  # a parameter read over its freed unsharded storage in backward
    if "its data is not allocated yet" in text:
        return "error:data-not-allocated"  # a freed (resized to 0) unsharded parameter used as it is
    if "attempting to assign a gradient with dtype" in text or "assigned grad has data of a different type" in text:
        return "error:grad-dtype-mismatch"
    return "error:other"


def failure_tags(spec: CaseSpec, pred: ClipPrediction, world_size: int) -> set[str]:
    """The case's facts, for a HANG or CRASH that a finding describes."""
    return set(pred.tags)


def ranks_tags(spec: CaseSpec, pred: ClipPrediction, obs_list: list[ClipObservation]) -> set[str]:
    """The case's tags and the mechanism of any rank's error, for RANKS-AGREE
    (a rank that raised where another did not)."""
    tags = _tags(pred, obs_list)
    for o in obs_list:
        for err in (o.wrap_error, o.step_error, o.clip_error):
            if err:
                tags.add(error_tag(err))
    return tags


def _tags(pred: ClipPrediction, obs_list: list[ClipObservation]) -> set[str]:
    tags = set(pred.tags) | {backend_tag(obs_list[0])}
    if any(o.empty_local for o in obs_list):
        tags.add("shard:empty")  # some rank's local shard of a clipped gradient is empty
    return tags


@catalog.invariant(
    "CLIP-NORM",
    group="clip",
    api="fsdp1|fsdp2",
    scenario="clip",
    all_ranks=True,
    statement="Clipping sharded gradients (torch.nn.utils.clip_grad_norm_ or get_total_norm + clip_grads_with_norm_ over FSDP2's DTensor gradients, of every parameter or of one module's; FSDP1's clip_grad_norm_ method) returns on every rank the single-process total norm of the same gradients (norm types 1, 2, 3, inf; foreach on, off or default): frozen parameters add nothing, a tied parameter and an ignored one (its gradient averaged by the user) count once, a rank whose local shard of a gradient is empty neither raises nor changes the norm. Under mixed precision (bf16 compute, reduction in bf16 or fp32, FSDP1's keep_low_precision_grads) the gradients are the bf16 pipeline's: the norm equals that of FSDP's own gradients, gathered whole before the clip, to fp32 rounding (bf16 where returned in bf16); FSDP1's is returned in float32 where its parameters and gradients are.",
    source=DOC_CLIP,
)
def check_norm(spec: CaseSpec, pred: ClipPrediction, obs: list[ClipObservation]) -> list[Violation] | NotChecked:
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    tags = _tags(pred, obs)
    first = obs[0]
    if first.wrap_error or first.step_error:
        err = first.wrap_error or first.step_error
        return [violation("CLIP-NORM", f"FSDP raised before clipping: {err}", tags, "kind:raised", "at:training", error_tag(err))]
    if any(o.gather_error for o in obs):
        return NotChecked("FSDP's gradients could not be read whole before the clip (CLIP-GRADS reports it): no norm to compare with")
    out = []
    for o in obs:
        if o.clip_error:
            out.append(violation("CLIP-NORM", f"rank {o.rank}: clipping raised {o.clip_error}", tags, "kind:raised", error_tag(o.clip_error)))
    if out:
        skipped = [o.rank for o in obs if o.peer_failed]
        if skipped:
            out[0] = violation("CLIP-NORM", out[0].message + f" (ranks {skipped} did not call it: they would wait in its reduction)",
                               set(out[0].tags))
        return out
    if not first.values_meaningful:
        return VALUES_UNCHECKED
    for o in obs:
        if o.norm_close is False:
            out.append(violation("CLIP-NORM", f"rank {o.rank}: total norm {o.norm:.6g}, single-process {o.ref_norm:.6g} "
                                 f"(norm_type {pred.plan.norm_type})", tags, "kind:norm"))
        if pred.norm_dtype and o.norm_dtype and o.norm_dtype != pred.norm_dtype:
            out.append(violation("CLIP-NORM", f"rank {o.rank}: total norm returned as {o.norm_dtype}, promised {pred.norm_dtype} "
                                 f"(the largest dtype of the parameters/gradients: {', '.join(o.grad_dtypes)})", tags, "kind:dtype"))
    return out


@catalog.invariant(
    "CLIP-GRADS",
    group="clip",
    api="fsdp1|fsdp2",
    scenario="clip",
    statement="After clipping, every parameter's full gradient (read as the change an SGD step of lr 1 makes) equals the single-process clipped gradient: the clipped ones scaled by max_norm / total norm when that is below 1, the others (outside the clipped module) left as they are; frozen parameters unchanged with grad None. Under mixed precision: FSDP's own gradients gathered before the clip, scaled by max_norm / their norm (to bf16 rounding where kept in bf16).",
    source=DOC_CLIP,
)
def check_grads(spec: CaseSpec, pred: ClipPrediction, obs: ClipObservation) -> list[Violation] | NotChecked:
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    tags = _tags(pred, [obs])
    if obs.wrap_error or obs.step_error:
        err = obs.wrap_error or obs.step_error
        return [violation("CLIP-GRADS", f"FSDP raised before clipping: {err}", tags, "kind:raised", "at:training", error_tag(err))]
    if obs.gather_error:
        return [violation("CLIP-GRADS", f"reading FSDP's gradients whole before the clip raised: {obs.gather_error}", tags,
                          "kind:grads-unreadable", error_tag(obs.gather_error))]
    if obs.failed:
        return NotChecked("clipping raised on some rank (CLIP-NORM): no clipped gradients to compare")
    if obs.read_error:
        return [violation("CLIP-GRADS", f"the SGD step after the clip or the read of its full values raised: {obs.read_error}", tags,
                          "kind:raised", "at:after-clip", error_tag(obs.read_error))]
    frozen = set(pred.training.frozen)
    out = []
    for fqn, none in obs.frozen_grads_none:
        if not none:
            out.append(violation("CLIP-GRADS", f"frozen parameter {fqn} has a gradient", tags, "kind:frozen-grad"))
    if not obs.values_meaningful:
        return out or VALUES_UNCHECKED
    if not obs.scale_finite:  # CLIP-NORM compares the norms, overflowed ones included
        return out or NotChecked(f"the total norm the gradients are scaled by is {obs.own_norm if obs.own_norm is not None else obs.ref_norm} "
                                 f"(norm_type {pred.plan.norm_type} overflows float32): max_norm / that norm scales nothing comparable")
    clipped = set(obs.clipped)
    for p in obs.params:
        if p.fqn in frozen and not p.unchanged:
            out.append(violation("CLIP-GRADS", f"frozen parameter {p.fqn} changed", tags, "kind:frozen-changed"))
        elif p.close is False:
            where = "clipped" if p.fqn in clipped else "not clipped"
            out.append(violation("CLIP-GRADS", f"{p.fqn} ({where}): gradient differs from single-process by {p.max_diff:.3g}",
                                 tags, "kind:grad", f"param:{where.replace(' ', '-')}"))
    return out


INVARIANTS = tuple(catalog.invariants)
