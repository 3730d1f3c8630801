"""What gradient clipping promises of a case (CLIP-NORM, CLIP-GRADS), from
the docstrings alone: torch.nn.utils.clip_grad_norm_ / get_total_norm ("the
norm is computed over the norms of the individual gradients of all
parameters, as if the norms of the individual gradients were concatenated
into a single vector") and FullyShardedDataParallel.clip_grad_norm_ (the
same norm, "handles the fact that gradients are sharded across ranks"):
under FSDP the norm of the gradients the single-process model has, on every
rank. Under mixed precision (the plan's precision) the gradients are
those of a bf16 forward and backward: the norm and gradients equal the
fp32 reference's to that rounding.

FSDP1's method also promises the norm's dtype: "The total norm returned
will have the 'largest' dtype across all parameters/gradients as defined by
PyTorch's type promotion semantics."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from conformance.areas.common.fsdp2_oracle import fsdp2_case_tags
from conformance.areas.common.training_oracle import TrainingPrediction, predict_training
from conformance.case.spec import CaseSpec, ClipPlan
from conformance.case.target import graph_of


@dataclass(frozen=True)
class ClipPrediction:
    training: TrainingPrediction
    plan: ClipPlan
    applicable: str  # "" or why the case is outside what clipping promises
    tags: frozenset[str]  # the case's facts a finding may be matched on
    # FSDP1's clip_grad_norm_: the returned norm's dtype ("the 'largest' dtype
    # across all parameters/gradients"); None where the docstring leaves it
    # open (FSDP2's nn.utils functions promise none; FSDP1 with
    # keep_low_precision_grads: bf16 gradients on fp32 parameters)
    norm_dtype: str | None = None


@functools.lru_cache(maxsize=256)
def predict_clip(spec: CaseSpec) -> ClipPrediction:
    """Clipping is promised wherever training is (training_oracle): the
    gradients it scales are training's."""
    training = predict_training(spec)
    plan = spec.clip or ClipPlan()
    g = graph_of(spec)
    tags = {f"api:{spec.plan.api}", f"way:{plan.way}", f"norm:{plan.norm_type}", f"foreach:{str(plan.foreach).lower()}"}
    if spec.plan.api == "fsdp1":
        tags.add(f"uop:{str(spec.plan.use_orig_params).lower()}")
    if plan.subset is not None:
        tags.add("subset")
    if training.frozen:
        tags.add("frozen")
    if any(len(g.aliases(pid)) > 1 for _, pid in g.named_parameters()):
        tags.add("tie")
    if spec.plan.ignored_params or spec.plan.ignored_modules:
        tags.add("ignored")
        clipped = set(g.subtree_params(g.resolve_module(plan.subset or "")))
        ignored = {g.resolve_param(f) for f in spec.plan.ignored_params}
        for path in spec.plan.ignored_modules:
            ignored |= set(g.subtree_params(g.resolve_module(path)))
        if any(g.requires_grad(pid) for pid in clipped & ignored):
            tags.add("clipped:ignored-trainable")  # a plain-tensor gradient among the clipped ones
    if training.fsdp2 is not None:
        # FSDP2's list-group facts its own findings match on (a group whose
        # last module's output needs no gradient, run again after it), and a
        # ModuleList/ModuleDict subclass with a forward given to fully_shard
        tags |= {t for t in fsdp2_case_tags(spec, training.fsdp2)
                 if t.startswith(("group:multi-frozen-embedding", "group:rerun-after")) or t == "container-subclass"}
    pr = plan.precision
    if pr is not None:
        tags.add(f"mp:param-{pr.param_dtype}")
        tags.add(f"mp:reduce-{pr.reduce_dtype or pr.param_dtype}")
        if pr.keep_low_precision_grads:
            tags.add("mp:keep-low-precision-grads")
    norm_dtype = None
    if spec.plan.api == "fsdp1" and not (pr is not None and pr.keep_low_precision_grads):
        # fp32 parameters, and fp32 gradients (upcast after the reduction when
        # mixed precision is on): fp32 whichever way "parameters/gradients" reads
        norm_dtype = "float32"
    return ClipPrediction(training, plan, training.applicable, frozenset(tags), norm_dtype)
