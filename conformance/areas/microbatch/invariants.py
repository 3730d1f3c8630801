"""MB-COMMS, MB-GRADS, MB-SHARDED: FSDP2's schedule APIs drawn per
microbatch (set_requires_gradient_sync, set_requires_all_reduce,
set_reshard_after_backward, set_is_last_backward, set_reshard_after_forward,
explicit unshard() / reshard(), reshard_after_forward as an int,
shard_placement_fn, set_unshard_in_backward, reset_iter_state after an
aborted iteration) against the oracle and the large batch."""

from __future__ import annotations

import torch

from conformance.areas.common.catalog import VALUES_UNCHECKED, Catalog, NotChecked
from conformance.areas.common.comm_checks import compare_collectives, compare_events
from conformance.areas.common.fsdp2_oracle import container_given_to_fully_shard, list_group_tags, predict_fsdp2
from conformance.areas.common.violations import backend_tag, freed_storage_tags, violation
from conformance.areas.microbatch.observation import MicrobatchObservation
from conformance.areas.microbatch.oracle import MicrobatchPrediction
from conformance.case.spec import CaseSpec
from conformance.case.tree import walk
from conformance.case.violation import Violation

catalog = Catalog()

GRAD_RTOL = 1e-5  # fp32 throughout: summation order only
DOCS = ("FSDPModule docstrings: set_requires_gradient_sync (\"gradient accumulation *without communication*\"), "
        "set_requires_all_reduce (\"gradient accumulation with only reduce-scatter but not all-reduce for HSDP\"), set_reshard_after_backward, set_is_last_backward, set_reshard_after_forward, unshard / reshard, "
        "UnshardHandle.wait, set_unshard_in_backward (\"expert cases when the user knows that all parameters in this FSDP module's "
        "parameter group are not needed for backward computation (e.g. embedding)\"); "
        "fully_shard docstring (reshard_after_forward as an int, shard_placement_fn); "
        "reset_iter_state docstring (after an exception aborted a forward or backward: call it on the root, then run the next "
        "iteration normally; the failed iteration's gradients are lost, no_sync grad-accumulation state included, and a "
        "gradient-accumulation sequence is to be restarted); set_all_reduce_hook (\"hook(reduce_output)\" where reduce_output \"is the "
        "reduce-scatter output if only using FSDP\"); set_custom_all_gather / set_custom_reduce_scatter (\"Overrides the default "
        "all_gather / reduce_scatter communication behavior\"); set_reduce_scatter_unused_params (\"include zero gradients for "
        "parameters that did not receive a gradient in backward. This is needed when different ranks use different parameters due "
        "to conditional control flow\"); set_separate_reduce_scatter_group (\"FSDP creates a dedicated process group over the shard "
        "ranks ... one per distinct set of shard ranks\"; \"False resets it to the shared shard/all-gather group\")")


def case_tags(spec: CaseSpec, pred: MicrobatchPrediction, obs: MicrobatchObservation) -> set[str]:
    return _tags(spec, pred, obs.world_size)


def failure_tags(spec: CaseSpec, pred: MicrobatchPrediction, world_size: int) -> set[str]:
    """A HANG or CRASH of a microbatch example (no observation) on a pool of
    ``world_size`` ranks: the case's tags, the oracle's notes for that world
    (a mesh's is its own size), so that a finding whose mechanism stops some
    ranks is KNOWN on it."""
    world = spec.microbatch.mesh[0] * spec.microbatch.mesh[1] if spec.microbatch.mesh is not None else world_size
    return _tags(spec, pred, world)


def _tags(spec: CaseSpec, pred: MicrobatchPrediction, world: int) -> set[str]:
    mb = spec.microbatch
    steps = mb.microbatches
    tags = {"api:fsdp2", f"microbatches:{min(len(steps), 3)}"}
    for name, flag in (("no-sync", any(not s.sync for s in steps)), ("no-all-reduce", any(not s.all_reduce for s in steps)),
                       ("no-reshard-after-backward", any(not s.reshard_after_backward for s in steps)),
                       ("not-last-backward", any(not s.is_last_backward for s in steps)),
                       ("set-reshard-after-forward", any(s.reshard_after_forward is not None for s in steps)),
                       ("explicit-unshard", any(s.unshard is not None for s in steps)),
                       ("async-unshard", any(s.unshard_async for s in steps)), ("explicit-reshard", any(s.reshard for s in steps)),
                       ("shard-dim1", bool(mb.shard_dim1)), ("grad-hooks", mb.grad_hooks),
                       ("reshard:int", any(isinstance(g.reshard_after_forward, int) and not isinstance(g.reshard_after_forward, bool)
                                           for g in spec.plan.groups))):
        if flag:
            tags.add(name)
    if container_given_to_fully_shard(spec):
        tags.add("container-subclass")  # a ModuleList/ModuleDict subclass with a forward, given to fully_shard
    if mb.abort is not None:
        tags.add(f"abort:{mb.abort.phase}")
    if mb.all_reduce_hook:
        tags.add("all-reduce-hook")
    if mb.custom_comms:
        tags.add("custom-comms")
    if any(s.unused_on_rank0 for s in steps):
        tags.add("unused-on-rank0")
    if any(s.separate_reduce_scatter is not None for s in steps):
        tags.add("separate-reduce-scatter-group")
    if mb.mesh is not None:
        tags.add(f"mesh:{mb.mesh[0]}x{mb.mesh[1]}")
    if any(len(g.modules) > 1 for g in spec.plan.groups):
        tags |= list_group_tags(spec, predict_fsdp2(spec, torch.__version__))
    if _frozen_int_reshard_group(spec):
        tags.add("group:frozen-int-reshard")  # see fsdp2-frozen-int-reshard-group-not-last-backward
    return tags | set(pred.expect(world).notes)


def _frozen_int_reshard_group(spec: CaseSpec) -> bool:
    """A group with an int reshard_after_forward whose parameters are all frozen."""
    from conformance.case.spec import module_at

    for g in spec.plan.groups:
        r = g.reshard_after_forward
        if not isinstance(r, int) or isinstance(r, bool):
            continue
        params = [q for path in g.modules for _, m in walk(module_at(spec.tree, path)) for q in m.params]
        if params and not any(q.requires_grad for q in params):
            return True
    return False


def _raised(inv: str, obs: MicrobatchObservation, tags: set[str]) -> list[Violation]:
    return [violation(inv, f"FSDP raised ({obs.error})", tags, "kind:raised", *freed_storage_tags(obs.error))] if obs.error else []


@catalog.invariant(
    "MB-COMMS",
    group="schedule_api",
    api="fsdp2",
    scenario="microbatch",
    statement="Each microbatch issues the oracle's collectives per group (count, numel, ranks, dtype) and its unshard / reshard / post-backward events, under the settings made before it: no reduce-scatter without gradient sync (the next synced one reduces what accumulated), no reshard after a backward told not to (and no all-gather in the next forward), an explicit unshard() all-gathers before the forward (async: once, waited on), reshard() frees, set_reshard_after_forward and an int reshard_after_forward as for COMM-COUNTS, Shard(1) moving the same numel; a group told set_unshard_in_backward(False) (one whose parameters backward does not read) all-gathers nothing in backward, neither in its pre-backward nor as a prefetch; after an iteration aborted by an exception and reset_iter_state() on the root, the restarted microbatches communicate as a fresh sequence; a group given set_all_reduce_hook has its hook called once per reduction of its gradients (each synced backward with gradients), with the reduce-scatter output (its numel, the reduce dtype), and none otherwise; a group given set_custom_all_gather and set_custom_reduce_scatter issues every all-gather and reduce-scatter of its own through them, and no other group's goes through them; with set_reduce_scatter_unused_params(True) a rank whose forward passed over some modules (conditional control flow) reduce-scatters what the others do, a zero gradient for each trainable parameter it did not use; after set_separate_reduce_scatter_group(True) every reduce-scatter runs on one process group over the shard ranks other than the all-gathers' (a new one after a set_separate_reduce_scatter_group(False), which puts them back on the shard group); on a 2-D (replicate, shard) mesh (HSDP) a reduction reduce-scatters over the shard dim and all-reduces the shard over the replicate dim only where set_requires_all_reduce is on, the all-reduce hook running after that all-reduce and not without it.",
    source=DOCS,
)
def check_comms(spec: CaseSpec, pred: MicrobatchPrediction, obs: MicrobatchObservation) -> list[Violation] | NotChecked:
    exp = pred.expect(obs.world_size)
    if exp.why or exp.order_why:
        return NotChecked(exp.why or exp.order_why)
    tags = case_tags(spec, pred, obs)
    return _raised("MB-COMMS", obs, tags) + compare_collectives("MB-COMMS", exp, obs, tags) + compare_events("MB-COMMS", exp, obs, tags)


@catalog.invariant(
    "MB-GRADS",
    group="schedule_api",
    api="fsdp2",
    scenario="microbatch",
    statement="Whatever the settings drawn per microbatch (set_unshard_in_backward(False) on groups whose parameters backward does not read included), after the last (synced) microbatch every trainable parameter's gradient equals the large batch's (the mean over ranks, summed over microbatches, of a single-process model's), and frozen parameters have none; so too where an exception aborted a forward or backward first (after some microbatches, with gradient sync on or off) and the sequence restarted after reset_iter_state() on the root and every gradient set to None: nothing of the aborted iteration remains; a group whose all-reduce hook scales the reduce-scatter output in place ends with its gradients scaled by that factor, and custom comms that issue the default collectives change no gradient; where rank 0 passed over some modules (set_reduce_scatter_unused_params(True)), every gradient is the mean over ranks of what each rank's own forward gives (a parameter rank 0 did not use counts zero from it); on a 2-D (replicate, shard) mesh (HSDP), reductions without the replicate all-reduce (set_requires_all_reduce(False)) lose nothing: the all-reducing one brings them in; a post-accumulate-grad hook on a trainable sharded parameter (an optimizer step in backward's) runs after FSDP2 writes its sharded gradient: at least once for every parameter that ends the sequence with a gradient, seeing that gradient in .grad at its last call, and never for one that ends without.",
    source=f"{DOCS}; Tensor.register_post_accumulate_grad_hook docstring (called after all gradients for the tensor have been accumulated: its .grad updated)",
)
def check_grads(spec: CaseSpec, pred: MicrobatchPrediction, obs: MicrobatchObservation) -> list[Violation] | NotChecked:
    tags = case_tags(spec, pred, obs) | {backend_tag(obs)}
    out = _raised("MB-GRADS", obs, tags)
    if obs.error:
        return out
    if obs.read_error:
        return [violation("MB-GRADS", f"reading what FSDP left after the last microbatch raised ({obs.read_error})", tags,
                          "kind:raised", "at:read")]
    out += _hook_violations(obs, tags)
    if not obs.values_meaningful:
        # the hooks are structure, compared on every tier: where some were,
        # the example is checked (PASS or its violations); else nothing was
        return out if out or obs.hooks else VALUES_UNCHECKED
    frozen = set(pred.frozen)
    for g in obs.grads:
        if g.fqn in frozen:
            if not g.none:
                out.append(violation("MB-GRADS", f"{g.fqn} is frozen but has a gradient", tags, "kind:frozen-grad"))
        elif g.none != g.ref_none:
            out.append(violation("MB-GRADS", f"{g.fqn}: gradient {'missing' if g.none else 'present'}, the large batch's {'none' if g.ref_none else 'present'}",
                                 tags, "kind:grad-missing" if g.none else "kind:grad-extra"))
        elif g.err > GRAD_RTOL:
            # grad:stale-at-reset: FSDP2 held an unsharded gradient of it when reset_iter_state ran (the oracle's stale_at_reset)
            stale = ("grad:stale-at-reset",) if g.fqn in pred.stale_at_reset else ()
            out.append(violation("MB-GRADS", f"{g.fqn}: gradient off the large batch's by {g.err:.3g} (relative, > {GRAD_RTOL:g})", tags, "kind:grad", *stale))
    if not obs.grads:
        return NotChecked("no gradient compared")
    return out


def _hook_violations(obs: MicrobatchObservation, tags: set[str]) -> list[Violation]:
    """MicrobatchPlan.grad_hooks: what each parameter's post-accumulate-grad
    hook saw against the gradient it ends with (structure: every tier)."""
    out = []
    for h in obs.hooks:
        if h.has_grad and not h.calls:
            out.append(violation("MB-GRADS", f"{h.fqn} has a gradient but its post-accumulate-grad hook never ran", tags, "kind:hook-not-run"))
        elif h.has_grad and h.last_is_final is False:
            out.append(violation("MB-GRADS", f"{h.fqn}: the gradient its post-accumulate-grad hook last saw is not the one it ends with "
                                 f"({h.calls} calls)", tags, "kind:hook-stale"))
        elif not h.has_grad and h.calls:
            out.append(violation("MB-GRADS", f"{h.fqn} ends without a gradient but its post-accumulate-grad hook ran {h.calls} times", tags,
                                 "kind:hook-without-grad"))
    return out


@catalog.invariant(
    "MB-SHARDED",
    group="schedule_api",
    api="fsdp2",
    scenario="microbatch",
    statement="After the last backward every parameter registered on the model is fully_shard's sharded DTensor (Shard on a 1-D mesh; Replicate, Shard on a 2-D one), and every gradient it has is a DTensor too, an aborted and reset iteration before the sequence included.",
    source="fully_shard docstring (the module's parameters are DTensors sharded on the mesh, registered back after forward / backward); set_reshard_after_backward docstring; reset_iter_state docstring (it reshards every parameter group)",
)
def check_sharded(spec: CaseSpec, pred: MicrobatchPrediction, obs: MicrobatchObservation) -> list[Violation] | NotChecked:
    tags = case_tags(spec, pred, obs)
    out = _raised("MB-SHARDED", obs, tags)
    if obs.error:
        return out
    exp = pred.expect(obs.world_size)
    if exp.why:
        return NotChecked(exp.why)
    if obs.read_error and not obs.shards:
        return [violation("MB-SHARDED", f"reading the parameters after the last microbatch raised ({obs.read_error})", tags,
                          "kind:raised", "at:read")]
    if not exp.iterations[-1].backward:
        # the root keeps its parameters unsharded after forward (fully_shard:
        # reshard_after_forward=None is False for the root) until a backward
        return NotChecked("the last microbatch's loss requires no gradient: no backward ran")
    for s in obs.shards:
        if not s.sharded:
            out.append(violation("MB-SHARDED", f"{s.fqn} is not a sharded DTensor after the last backward", tags, "kind:unsharded-param"))
        if s.grad_sharded is False:
            out.append(violation("MB-SHARDED", f"{s.fqn}'s gradient is not a DTensor after the last backward", tags, "kind:unsharded-grad"))
    if not obs.shards:
        return NotChecked("the case has no parameter")
    return out


INVARIANTS = tuple(catalog.invariants)
