"""The comm area's oracle: the plan's iterations under FSDP2 or FSDP1, each
iteration's collectives per group or unit and FSDP2's events, from
conformance.areas.common.comm_oracle (which states the promises and where
they are documented)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from conformance.areas.common.comm_oracle import ANY_TORCH, Expected, FSDP2Comm, Knobs, simulate_fsdp1, simulate_fsdp2, timeline
from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.areas.common.fsdp2_oracle import predict_fsdp2
from conformance.case.spec import CaseSpec, flip_requires_grad


@dataclass(frozen=True)
class CommPrediction:
    spec: CaseSpec

    def expect(self, world: int) -> Expected:
        return _expect(self.spec, world)


def predict_comm(spec: CaseSpec) -> CommPrediction:
    return CommPrediction(spec)


@functools.lru_cache(maxsize=512)
def _expect(spec: CaseSpec, world: int) -> Expected:
    c = spec.comm
    if spec.plan.api == "fsdp2":
        return simulate_fsdp2(spec, world, FSDP2Comm((Knobs(),) * c.iterations, c.param_dtype, c.reduce_dtype,
                                                     c.forward_prefetch, c.backward_prefetch, refreeze=c.refreeze))
    return simulate_fsdp1(spec, world, c)


@functools.lru_cache(maxsize=512)
def refreeze_tags(spec: CaseSpec) -> frozenset[str]:
    """``refreeze``: requires_grad flips between iterations; FSDP2
    ``group-trainable-later``: a group all frozen in the first iteration has
    a trainable parameter after it (fsdp2-unfreeze-frozen-group-mixed-precision's
    mechanism)."""
    c = spec.comm
    if c is None or not c.refreeze:
        return frozenset()
    out = {"refreeze"}
    if spec.plan.api == "fsdp2":
        before, later = predict_fsdp2(spec, ANY_TORCH), predict_fsdp2(flip_requires_grad(spec, c.refreeze), ANY_TORCH)
        trainable_later = {g.modules[0] for g in later.groups if g.trainable}
        if any(g.managed and not g.trainable and g.modules[0] in trainable_later for g in before.groups):
            out.add("group-trainable-later")
    elif _no_shard_frozen_left_unsharded(spec):
        out.add("unit:no-shard-frozen-left-unsharded")
    return frozenset(out)


def _no_shard_frozen_left_unsharded(spec: CaseSpec) -> bool:
    """FSDP1, use_orig_params=True, a NO_SHARD unit (the strategy, or any on
    each rank's own group, which FSDP1 runs as NO_SHARD) all frozen in the
    first iteration, its input needing no gradient and its output one, with a
    parameter the refreeze makes trainable: the first backward's pre-backward
    hook unshards it as plain tensor views, no post-backward hook reshards it
    and _catch_all_reshard takes NO_SHARD's flat parameter for already
    resharded (fsdp1-no-shard-frozen-unit-params-unregistered's mechanism);
    the refreeze then flips the views, not the parameters FSDP registered."""
    c = spec.comm
    if spec.plan.api != "fsdp1" or not spec.plan.use_orig_params or not (c.sharding_strategy == "NO_SHARD" or c.world == 1):
        return False
    units = predict_fsdp1(spec).units
    steps, _ = timeline(spec, frozenset(f for u in units if u.trainable for f in u.managed))
    enter = {s.path: s.grad for s in steps if s.kind == "enter"}
    leave = {s.path: s.grad for s in steps if s.kind == "exit"}
    return any(u.managed and not u.trainable and set(u.managed) & set(c.refreeze)
               and not enter.get(u.path, True) and leave.get(u.path, False) for u in units)
