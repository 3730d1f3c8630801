"""Strategies for FSDP2's schedule APIs drawn per microbatch (MB-*): the
trees of the comm strategies (frozen parameters included) under FSDP2
groups (reshard_after_forward None / True / False / 2), sometimes Shard(1)
for groups whose matrices allow it, and 1..N microbatches each with its own
gradient sync, all-reduce, reshard-after-backward, is_last_backward and
reshard_after_forward settings, explicit unshard() (sync or async, waited
on) and reshard() of a group; the last microbatch syncs, reshards and is
the last backward (what the APIs' documented use of them requires); in a
third of the cases an iteration aborted by an exception (in forward or
backward, at any module whose forward runs) and recovered with
reset_iter_state() before the sequence restarts; groups whose parameters
the backward does not read (no Linear or LayerNorm in them) told
set_unshard_in_backward(False), each a third of the time; groups given an
all-reduce hook (scaling the reduce-scatter output by a power of two of
their own; every microbatch then all-reduces) and groups given the suite's
custom all-gather and reduce-scatter, each a third of the time; in half
the cases without an abort, modules rank 0 passes over in some
microbatches (conditional control flow) with
set_reduce_scatter_unused_params(True); in a third,
set_separate_reduce_scatter_group(True) before the first microbatch and
sometimes False / True before later ones."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.areas.common.comm_oracle import param_shapes, timeline
from conformance.areas.common.fsdp2_oracle import predict_fsdp2
from conformance.areas.microbatch.oracle import unused_differs
from conformance.case.spec import (
    ABORT_PHASES,
    CONTAINER_BASES,
    HSDP_MESHES,
    CaseSpec,
    MicrobatchAbort,
    MicrobatchPlan,
    MicrobatchStep,
    ModuleSpec,
    ShardGroup,
    backward_free_group,
)
from conformance.strategies._common import ANY_TORCH, TreeIndex, check_bool, check_int, ints, maybe, pick, pick_subset
from conformance.strategies.cases import case_specs
from conformance.strategies.comm import RESHARD, draw_groups
from conformance.strategies.groups import shardable

THIRD = st.sampled_from((False, False, True))  # True a third of the time; shrinks to False
# an all-reduce hook's scale per hooked group, in draw order: powers of two
# (exact in float32), each group's its own so that one group's scale on
# another's gradients shows
HOOK_SCALES = (2.0, 0.5, 4.0, 0.25, 8.0, 0.125)
SHARD_DIM1_WORLD = 4  # Shard(1) needs dim 1 divisible by the world size: the fake tier's 4 (and so gloo's 2)


def _draw_step(draw: Any, modules: list[str], *, first: bool, last: bool) -> MicrobatchStep:
    raf = pick(draw, (None, True, False))
    unshard = None if first or not maybe(draw, 2) else pick(draw, modules)
    if last:
        return MicrobatchStep(all_reduce=not maybe(draw, 2), reshard_after_forward=raf, unshard=unshard,
                              unshard_async=unshard is not None and draw(st.booleans()),
                              reshard=unshard is not None and maybe(draw, 2))
    return MicrobatchStep(
        sync=not maybe(draw, 1), all_reduce=not maybe(draw, 2), reshard_after_backward=not maybe(draw, 2),
        is_last_backward=not maybe(draw, 2), reshard_after_forward=raf, unshard=unshard,
        unshard_async=unshard is not None and draw(st.booleans()), reshard=unshard is not None and maybe(draw, 2),
    )


@st.composite
def _microbatch_specs(draw: Any, base: SearchStrategy, max_groups: int, max_microbatches: int, cpu_offload: bool,
                      meshes: tuple[tuple[int, int], ...]) -> CaseSpec:
    spec = draw(base)
    if not timeline(spec, frozenset(f for f, (_, rg) in param_shapes(spec).items() if rg))[1] and draw(st.sampled_from((True, True, True, False))):
        # nothing trains: no backward, so no accumulation to check; mostly
        # the same tree with every parameter trainable instead
        spec = dataclasses.replace(spec, tree=_trainable(spec.tree))
    mesh = pick(draw, meshes) if meshes else None
    # an int reshard_after_forward is a factor of the shard dim's size (fully_shard raises otherwise)
    spec = draw_groups(draw, spec, RESHARD if mesh is None or mesh[1] % 2 == 0 else RESHARD[:3], max_groups)
    pred = predict_fsdp2(spec, ANY_TORCH)
    shapes = {f"{p}.{q.name}" if p else q.name: q.shape for p, m in _walk(spec.tree) for q in m.params}
    dim1_ok = [g.modules[0] for g in pred.groups if g.managed and all(len(shapes[f]) < 2 or shapes[f][1] % SHARD_DIM1_WORLD == 0 for f in g.managed)
               and any(len(shapes[f]) >= 2 for f in g.managed)]
    shard_dim1 = tuple(m for m in dim1_ok if maybe(draw, 1))
    modules = [g.modules[0] for g in spec.plan.groups if g.modules != ("",)] + [""]
    # mostly several microbatches (accumulation is the point); one sometimes
    n = draw(st.sampled_from((*range(2, max_microbatches + 1), 1)))  # shrinks to 2
    steps = tuple(_draw_step(draw, modules, first=k == 0, last=k == n - 1) for k in range(n))
    if shard_dim1:
        event("microbatch: Shard(1)")
    event(f"microbatch: {n} microbatches")
    abort = None
    if draw(THIRD):  # a third of the cases
        # at a module whose forward runs; the aborted microbatch and those
        # before it set no reshard_after_forward (reset_iter_state restores no setting)
        called = [p for p, m in _walk(spec.tree) if m.cls not in CONTAINER_BASES]
        abort = MicrobatchAbort(before=draw(ints(n - 1)) if n > 1 else 0, at=pick(draw, called), phase=pick(draw, ABORT_PHASES))
        steps = tuple(dataclasses.replace(s, reshard_after_forward=None) if k <= abort.before else s for k, s in enumerate(steps))
        event(f"microbatch: aborted in {abort.phase}, reset_iter_state")
    # groups whose parameters backward does not read, told so: each a third of the time
    no_bw = tuple(g.modules[0] for g in pred.groups if g.managed and backward_free_group(spec, g.modules[0]) and draw(THIRD))
    if no_bw:
        event("microbatch: set_unshard_in_backward(False)")
    # all-reduce hooks and custom comms on groups with parameters, each a third of the time
    with_params = [g.modules[0] for g in pred.groups if g.managed]
    hooked = [m for m in with_params if draw(THIRD)]
    hooks = tuple(zip(hooked[: len(HOOK_SCALES)], HOOK_SCALES))
    if mesh is not None:
        # HSDP: the last microbatch all-reduces what the sequence reduce-scattered
        steps = steps[:-1] + (dataclasses.replace(steps[-1], all_reduce=True),)
        event(f"microbatch: HSDP mesh {mesh}")
    if hooks:
        if mesh is None:
            # a 1-D mesh's all-reduce is the hook: every microbatch all-reduces
            # (whether set_requires_all_reduce(False) skips it is left open)
            steps = tuple(dataclasses.replace(s, all_reduce=True) for s in steps)
        event("microbatch: set_all_reduce_hook")
    custom = tuple(m for m in with_params if draw(THIRD))
    if custom:
        event("microbatch: set_custom_all_gather / set_custom_reduce_scatter")
    if draw(THIRD):
        # reduce-scatters on a process group of their own from the first
        # microbatch, sometimes back on the shard group (and off again) later
        steps = tuple(dataclasses.replace(s, separate_reduce_scatter=True if k == 0 else pick(draw, (None, None, False, True)))
                      for k, s in enumerate(steps))
        event("microbatch: set_separate_reduce_scatter_group")
    # post-accumulate-grad hooks on every trainable parameter (an optimizer step in backward's), a third of the time
    grad_hooks = draw(THIRD)
    if grad_hooks:
        event("microbatch: register_post_accumulate_grad_hook")
    plan = MicrobatchPlan(steps, shard_dim1=shard_dim1, cpu_offload=cpu_offload, abort=abort, no_unshard_in_backward=no_bw,
                          all_reduce_hook=hooks, custom_comms=custom, mesh=mesh, grad_hooks=grad_hooks)
    if abort is None and maybe(draw, 2):
        spec, plan = _draw_unused(draw, spec, plan)
    return dataclasses.replace(spec, microbatch=plan)


def _safe_alone(spec: CaseSpec, path: str, mesh: tuple[int, int] | None) -> bool:
    """Passed over alone on rank 0 in one microbatch, ``path`` leaves every
    rank's FSDP hooks the same."""
    one = MicrobatchPlan((MicrobatchStep(unused_on_rank0=(path,)),), reduce_scatter_unused_params=True, mesh=mesh)
    return not unused_differs(dataclasses.replace(spec, microbatch=one))


def _group_around(draw: Any, spec: CaseSpec, plan: MicrobatchPlan, candidates: list[str]) -> tuple[CaseSpec, list[str]]:
    """Where no candidate lies in a group below the root: one candidate's
    parent given to fully_shard of its own (a group below the root the
    module is unused in), if FSDP2 supports the plan then, every group the
    plan names keeps a parameter and the candidate stays safe; else the
    spec as it was and no candidate."""
    index = TreeIndex(spec.tree, spec.classes)
    grouped = {m for g in spec.plan.groups for m in g.modules}
    parents = [c for c in candidates if c.rpartition(".")[0] and shardable(index, c.rpartition(".")[0])
               and c.rpartition(".")[0] not in grouped]
    if not parents:
        return spec, []
    c = pick(draw, parents)
    out = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, groups=spec.plan.groups + (ShardGroup((c.rpartition(".")[0],)),)))
    pred = predict_fsdp2(out, ANY_TORCH)
    named = {p for p, _ in plan.all_reduce_hook} | set(plan.custom_comms) | set(plan.no_unshard_in_backward) | set(plan.shard_dim1)
    if pred.supported or not named <= {g.modules[0] for g in pred.groups if g.managed} or not _safe_alone(out, c, plan.mesh):
        return spec, []
    event("microbatch: a group made around a module unused on rank 0")
    return out, [c]


def _draw_unused(draw: Any, spec: CaseSpec, plan: MicrobatchPlan) -> tuple[CaseSpec, MicrobatchPlan]:
    """Modules rank 0 passes over in some microbatches (1..2 each, in about
    half of them, always one), with set_reduce_scatter_unused_params(True):
    modules with a trainable parameter that neither are nor hold a module
    given to fully_shard, and that passed over alone leave FSDP's hooks
    running on rank 0 as on the others; none where the whole choice would
    not (the ranks' collectives would differ: the user's program, not
    FSDP, is wrong)."""
    grouped = {m for g in spec.plan.groups for m in g.modules}
    trainable = {f for f, (_, rg) in param_shapes(spec).items() if rg}
    candidates = [p for p, _ in _walk(spec.tree) if p and not any(m == p or m.startswith(p + ".") for m in grouped)
                  and any(f.startswith(p + ".") for f in trainable)]
    # those that, passed over alone in one microbatch, leave every rank's hooks the same
    candidates = [p for p in candidates if _safe_alone(spec, p, plan.mesh)]
    if not candidates:
        event("microbatch: no module rank 0 can pass over alone")
        return spec, plan
    # mostly inside a group below the root (one made around a candidate
    # where there is none): the root's group alone does not show whether
    # the setting reached the others
    nested = [p for p in candidates if any(p.startswith(m + ".") for m in grouped if m)]
    if not nested and maybe(draw, 2):
        spec, nested = _group_around(draw, spec, plan, candidates)
        if nested:  # a candidate the new group is, or holds, is one no more
            grouped = {m for g in spec.plan.groups for m in g.modules}
            candidates = [p for p in candidates if not any(m == p or m.startswith(p + ".") for m in grouped)]
    if nested and not maybe(draw, 3):
        candidates = nested
    n = len(plan.microbatches)
    chosen = draw(ints(n - 1))  # the microbatch that surely has one
    steps = tuple(dataclasses.replace(s, unused_on_rank0=tuple(sorted(pick_subset(draw, candidates, min_size=1, max_size=2))))
                  if k == chosen or maybe(draw, 2) else s for k, s in enumerate(plan.microbatches))
    out = dataclasses.replace(plan, microbatches=steps, reduce_scatter_unused_params=True)
    if unused_differs(dataclasses.replace(spec, microbatch=out)):
        event("microbatch: unused on rank 0 dropped (the hooks would run otherwise there)")
        return spec, plan
    event("microbatch: modules unused on rank 0, set_reduce_scatter_unused_params")
    return spec, out


def _trainable(m: ModuleSpec) -> ModuleSpec:
    return dataclasses.replace(m, params=tuple(dataclasses.replace(p, requires_grad=True) for p in m.params),
                               children=tuple(_trainable(c) for c in m.children))


def _walk(tree, path=""):
    yield path, tree
    for c in tree.children:
        yield from _walk(c, f"{path}.{c.name}" if path else c.name)


def microbatch_specs(*, max_modules: int = 8, max_depth: int = 3, max_groups: int = 4, max_microbatches: int = 4,
                     cpu_offload: bool = False, meshes: tuple[tuple[int, int], ...] = ()) -> SearchStrategy[CaseSpec]:
    """FSDP2 CaseSpecs with a MicrobatchPlan (see the module docstring);
    with ``cpu_offload`` every group gets CPUOffloadPolicy(); with
    ``meshes`` ((replicate, shard) shapes of HSDP_MESHES), every case is
    on one of them (HSDP: set_requires_all_reduce then decides the
    replicate all-reduce, the last microbatch's on)."""
    for name, v in (("max_modules", max_modules), ("max_groups", max_groups), ("max_microbatches", max_microbatches)):
        check_int(v, name, min_value=1)
    check_int(max_depth, "max_depth", min_value=0)
    check_bool(cpu_offload, "cpu_offload")
    if not isinstance(meshes, tuple) or any(tuple(m) not in HSDP_MESHES for m in meshes):
        raise InvalidArgument(f"meshes={meshes!r} must be a tuple of shapes from {HSDP_MESHES}")
    base = case_specs(max_modules=max_modules, max_depth=max_depth, apis=st.just("fsdp2"), use_orig_params=st.just(False),
                      policies=[None], allow_ties=False, allow_shared=False, allow_ignored=False)
    return _microbatch_specs(base, max_groups, max_microbatches, cpu_offload, tuple(tuple(m) for m in meshes))
