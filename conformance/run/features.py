"""Case features: the kinds of case that are common in real models and easy
for random drawing to miss (all-frozen units, uneven and empty shards,
shared modules, one-element parameters). Each example reports its features
as Hypothesis events (``--hypothesis-show-statistics``) and the report
counts them per invariant, so that a profile's reach is measured, not guessed."""

from __future__ import annotations

from conformance.case.graph import ModelGraph
from conformance.case.spec import CaseSpec

FEATURES = (
    "tie",
    "shared module",
    "one-element parameter",
    "uneven shard",  # FSDP2: a dim-0 not divisible by W; FSDP1: a unit's numel not divisible by W
    "empty shard",  # FSDP2: a dim-0 below W; FSDP1: a unit with fewer elements than W
    "all-frozen unit",  # an FSDP1 unit / FSDP2 group whose parameters are all frozen
    "mixed unit",  # frozen and trainable parameters in one unit / group
)


def case_features(spec: CaseSpec, world_size: int) -> list[str]:
    """For a CaseSpec or a ModelCase (a real model's ties and shared modules
    are read off its graph)."""
    # torch and the oracles: the report renders FEATURES without them
    from conformance.case.target import graph_of

    g = graph_of(spec)
    params = [pid for _, pid in g.named_parameters()]
    out = []
    if spec.ties or any(len(g.users(p)) > 1 for p in params):
        out.append("tie")
    if spec.shared or g.shared_modules():
        out.append("shared module")
    if any(g.numel(p) == 1 for p in params):
        out.append("one-element parameter")
    units = _units(spec, g)
    if spec.plan.api == "fsdp2":
        dim0 = [g.param_info[p].shape[0] if g.param_info[p].shape else 1 for p in params]
        uneven, empty = any(d % world_size for d in dim0), any(d < world_size for d in dim0)
    else:
        sizes = [sum(g.numel(p) for p in u) for u in units if u]
        uneven, empty = any(n % world_size for n in sizes), any(n < world_size for n in sizes)
    if uneven:
        out.append("uneven shard")
    if empty:
        out.append("empty shard")
    flags = [{g.requires_grad(p) for p in u} for u in units if u]
    if any(f == {False} for f in flags):
        out.append("all-frozen unit")
    if any(f == {True, False} for f in flags):
        out.append("mixed unit")
    return out


def _units(spec: CaseSpec, g: ModelGraph) -> list[list[str]]:
    """The parameter ids each unit (FSDP1) or group (FSDP2) manages, per the oracle."""
    # (imported here for the reason case_features gives)
    import torch

    from conformance.areas.common.fsdp1_oracle import predict_fsdp1
    from conformance.areas.common.fsdp2_oracle import predict_fsdp2

    if spec.plan.api == "fsdp2":
        pred = predict_fsdp2(spec, torch.__version__)
        return [[g.resolve_param(f) for f in grp.managed] for grp in pred.groups]

    pred = predict_fsdp1(spec)
    if pred.error is not None and not pred.units:
        return []
    return [[g.resolve_param(f) for f in u.managed] for u in pred.units]
