"""The microbatch oracle: what FSDP2 communicates in each microbatch under
the schedule settings drawn for it (conformance.areas.common.comm_oracle,
with set_requires_gradient_sync, set_reshard_after_backward,
set_is_last_backward, set_reshard_after_forward and explicit unshard() /
reshard() as its docstrings state them; set_requires_all_reduce governs
HSDP's all-reduce only, of which a 1-D mesh has none), and which gradients
the microbatches accumulate: the large batch's, the mean over ranks summed
over microbatches (set_requires_gradient_sync: "gradient accumulation
*without communication*")."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from conformance.areas.common.comm_oracle import ANY_TORCH, Expected, FSDP2Comm, Knobs, param_shapes, simulate_fsdp2, timeline
from conformance.areas.common.fsdp2_oracle import predict_fsdp2
from conformance.case.graph import ModelGraph
from conformance.case.spec import CaseSpec, module_at


@dataclass(frozen=True)
class MicrobatchPrediction:
    spec: CaseSpec
    trainable: tuple[str, ...]  # canonical FQNs: each ends with the large batch's gradient
    frozen: tuple[str, ...]  # each ends with no gradient
    # MicrobatchAbort: the parameters FSDP2 holds an unsharded gradient of
    # when reset_iter_state runs (stale_at_reset), which the docstring has it discard
    stale_at_reset: frozenset[str] = frozenset()
    # (FQN, scale): the trainable parameters of a group given an all-reduce
    # hook that scales the reduce-scatter output in place: their gradients
    # are the large batch's times that scale (each reduction's output is
    # scaled before it accumulates into the sharded gradient)
    grad_scale: tuple[tuple[str, float], ...] = ()

    def expect(self, world: int) -> Expected:
        return _expect(self.spec, world)


def knobs(spec: CaseSpec) -> tuple[Knobs, ...]:
    return tuple(Knobs(s.sync, s.reshard_after_backward, s.is_last_backward, s.reshard_after_forward, s.unshard, s.reshard)
                 for s in spec.microbatch.microbatches)


def _comm(spec: CaseSpec, skips: tuple[frozenset[str], ...] = ()) -> FSDP2Comm:
    mb = spec.microbatch
    return FSDP2Comm(knobs(spec), shard_dim1=mb.shard_dim1, no_backward_unshard=mb.no_unshard_in_backward,
                     all_reduce_hook=tuple(p for p, _ in mb.all_reduce_hook), custom_comms=mb.custom_comms, skips=skips,
                     separate_rs=tuple(s.separate_reduce_scatter for s in mb.microbatches)
                     if any(s.separate_reduce_scatter is not None for s in mb.microbatches) else (),
                     replicate=mb.mesh[0] if mb.mesh is not None else 0, all_reduce=tuple(s.all_reduce for s in mb.microbatches))


@functools.lru_cache(maxsize=512)
def _expect(spec: CaseSpec, world: int) -> Expected:
    # every rank's: set_reduce_scatter_unused_params has a rank that passed
    # over some modules reduce-scatter what the others do (a zero gradient
    # for each trainable parameter it did not use), and unused_differs keeps
    # the cases whose FSDP hooks run the same on every rank
    mesh = spec.microbatch.mesh
    if mesh is None:
        return simulate_fsdp2(spec, world, _comm(spec))
    if mesh[0] * mesh[1] != world:
        return Expected(why=f"a {mesh[0]}x{mesh[1]} mesh on {world} ranks")
    return simulate_fsdp2(spec, mesh[1], _comm(spec))  # sharded over the shard dim's ranks


@functools.lru_cache(maxsize=512)
def unused_differs(spec: CaseSpec) -> str | None:
    """Why the modules rank 0 passes over (MicrobatchStep.unused_on_rank0)
    would have FSDP's hooks run otherwise on rank 0 than on the others, or
    None. Where they would (a group's post-backward hook fired by autograd
    on one rank and by the root's final callback on another, a loss that
    needs no gradient on rank 0 alone), the ranks' collectives come in
    different orders: the user's program is wrong, whatever FSDP does."""
    steps = spec.microbatch.microbatches
    if not any(s.unused_on_rank0 for s in steps):
        return None
    mesh = spec.microbatch.mesh
    world = 2 if mesh is None else mesh[0] * mesh[1]
    base = _expect(spec, world)
    rank0 = simulate_fsdp2(spec, 2 if mesh is None else mesh[1], _comm(spec, tuple(frozenset(s.unused_on_rank0) for s in steps)))
    if base.why or rank0.why or base.order_why:
        return base.why or rank0.why or base.order_why
    if rank0.iterations != base.iterations:
        k = next(i for i, (a, b) in enumerate(zip(rank0.iterations, base.iterations)) if a != b)
        return (f"microbatch {k}: passing over {', '.join(steps[k].unused_on_rank0)} on rank 0 changes which FSDP hooks run, "
                "or in what order: the ranks' collectives would differ")
    return None


@functools.lru_cache(maxsize=512)
def predict_microbatch(spec: CaseSpec) -> MicrobatchPrediction:
    g = ModelGraph(spec)
    return MicrobatchPrediction(
        spec,
        tuple(f for f, pid in g.named_parameters() if g.requires_grad(pid)),
        tuple(f for f, pid in g.named_parameters() if not g.requires_grad(pid)),
        stale_at_reset(spec),
        grad_scale(spec),
    )


def grad_scale(spec: CaseSpec) -> tuple[tuple[str, float], ...]:
    hooks = dict(spec.microbatch.all_reduce_hook)
    if not hooks:
        return ()
    return tuple((f, hooks[grp.modules[0]]) for grp in predict_fsdp2(spec, ANY_TORCH).groups if grp.modules[0] in hooks
                 for f in grp.trainable)


def stale_at_reset(spec: CaseSpec) -> frozenset[str]:
    """The trainable parameters whose unsharded gradient FSDP2 holds when the
    case's reset_iter_state runs (MicrobatchAbort), from how FSDP2 keeps
    gradients, not from what the docstring promises (it discards them):

    - every one, where the last microbatch before the abort that ran a
      backward did so with gradient sync disabled (the accumulated
      unsharded gradient waits for a synced backward to reduce it);
    - in a backward aborted at ``at``: those of the modules whose forward
      began after ``at``'s ended (autograd reaches them before the raise),
      unless their group's post-backward ran and reduced them (with what
      accumulated before), which it does in a synced microbatch for a
      group whose first forward began after ``at``'s ended, given an input
      that requires grad (not an Embedding's index: its post-backward
      waits for the root's final callback, which an aborted backward never
      runs).

    A case without an abort, or whose loss needs no gradient, holds none."""
    a = spec.microbatch.abort if spec.microbatch is not None else None
    if a is None:
        return frozenset()
    trainable = frozenset(f for f, (_, rg) in param_shapes(spec).items() if rg)
    steps, loss = timeline(spec, trainable)
    if not loss:
        return frozenset()
    stale: set[str] = set()
    before = spec.microbatch.microbatches[: a.before]
    if before and not before[-1].sync:
        stale |= trainable
    if a.phase == "backward":
        end = next(i for i, s in enumerate(steps) if s.kind == "exit" and s.path == a.at)
        entered = {s.path: i for i, s in reversed(list(enumerate(steps))) if s.kind == "enter"}  # first entry
        later = {p for p, i in entered.items() if i > end}
        synced = spec.microbatch.microbatches[a.before].sync
        for grp in predict_fsdp2(spec, ANY_TORCH).groups:  # the group structure, as simulate_fsdp2 reads it
            first = min(grp.modules, key=lambda m: entered.get(m, len(steps)))
            if synced and first in later and module_at(spec.tree, first).cls != "Embedding":
                stale -= set(grp.managed)  # reduced, with what accumulated before
            else:
                stale |= {f for f in grp.managed if f in trainable and f.rpartition(".")[0] in later}
    return frozenset(stale)
