"""What gradient clipping promises of a case (CLIP-NORM, CLIP-GRADS), from
the docstrings alone: torch.nn.utils.clip_grad_norm_ / get_total_norm ("the
norm is computed over the norms of the individual gradients of all
parameters, as if the norms of the individual gradients were concatenated
into a single vector") and FullyShardedDataParallel.clip_grad_norm_ (the
same norm, "handles the fact that gradients are sharded across ranks"):
under FSDP the norm of the gradients the single-process model has, on every
rank."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from conformance.areas.common.training_oracle import TrainingPrediction, predict_training
from conformance.case.spec import CaseSpec, ClipPlan
from conformance.case.target import graph_of


@dataclass(frozen=True)
class ClipPrediction:
    training: TrainingPrediction
    plan: ClipPlan
    applicable: str  # "" or why the case is outside what clipping promises
    tags: frozenset[str]  # the case's facts a finding may be matched on


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
    return ClipPrediction(training, plan, training.applicable, frozenset(tags))
