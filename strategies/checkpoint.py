"""Strategies for checkpoint cases: a case, the world size it is saved under,
the plan (another wrap policy or FSDP2 grouping, the other API) and world
size it is loaded under, the optimizer and its steps, freeze changes, and
how a full state dict is taken or loaded."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.areas.checkpoint.oracle import predict_ckpt
from conformance.areas.common.training_oracle import predict_training
from conformance.case.graph import ModelGraph
from conformance.case.spec import CKPT_OPTIMIZERS, CKPT_PRECISIONS, LOAD_PATHS, CaseSpec, CheckpointPlan, ModuleWrap, WrapPlan
from conformance.strategies._common import check_int, ints, maybe, pick, pick_subset
from conformance.strategies.cases import case_specs
from conformance.strategies.groups import draw_groups, fsdp2_case_specs
from conformance.strategies.training import fsdp1_trainable

KINDS = ("full", "ties", "reshard", "optim")
# The base pool's world size first (cheapest), then the driver (1), then 3:
# 3 does not divide most dimensions and exceeds the smallest (empty shards).
WORLDS = (2, 1, 3)


def _trainable(spec: CaseSpec) -> bool:
    return not predict_training(spec).applicable


def _bases(api: str, max_modules: int, ties: bool) -> SearchStrategy[CaseSpec]:
    if api == "fsdp2":
        base = fsdp2_case_specs(max_modules=max_modules, max_depth=3, methods=False)
    else:
        base = case_specs(max_modules=max_modules, max_depth=3, allow_ignored=False, allow_shared=False).filter(fsdp1_trainable)
    base = base.filter(_trainable).filter(lambda s: any(True for _ in ModelGraph(s).named_parameters()))
    if ties:
        base = base.filter(lambda s: bool(s.ties or s.shared))
    return base


def draw_load_plan(draw: Any, spec: CaseSpec, api: str) -> WrapPlan:
    """Another plan for the same tree: FSDP2 groups, or FSDP1 with a
    ModuleWrapPolicy over some drawn classes (either use_orig_params)."""
    if api == "fsdp2":
        groups = draw_groups(draw, dataclasses.replace(spec, plan=WrapPlan(api="fsdp2")), max_groups=3, split_ties=False)
        return WrapPlan(api="fsdp2", groups=groups)
    classes = [c.name for c in spec.classes if c.name != spec.tree.cls]
    chosen = pick_subset(draw, classes, min_size=0, max_size=2)
    return WrapPlan(api="fsdp1", policy=ModuleWrap(tuple(chosen)) if chosen else None, use_orig_params=maybe(draw, 1))


def _trains_after_load(spec: CaseSpec) -> bool:
    """Whether the load side may train on: FSDP2, or an FSDP1 plan that
    FSDP1's own training cases would draw (fsdp1_trainable)."""
    load = spec.ckpt.load_plan or spec.plan
    return load.api == "fsdp2" or fsdp1_trainable(dataclasses.replace(spec, plan=load))


def per_parameter(spec: CaseSpec) -> bool:
    """Optimizers over the original parameters at the save and the load
    (FSDP2, or FSDP1 with use_orig_params=True): parameter groups by name."""
    return all(p.api == "fsdp2" or p.use_orig_params for p in (spec.plan, spec.ckpt.load_plan or spec.plan))


def _fits(spec: CaseSpec) -> bool:
    try:
        return not predict_ckpt(spec).applicable and (spec.plan.api == "fsdp2" or fsdp1_trainable(spec))
    except Exception:
        return False


@st.composite
def _checkpoint_specs(draw: Any, kind: str, bases: dict) -> CaseSpec:
    api = pick(draw, tuple(bases))
    spec = draw(bases[api])
    g = ModelGraph(spec)
    canon = [pid for _, pid in g.named_parameters()]  # parameter ids: spec FQNs
    save_world = pick(draw, WORLDS)
    event(f"api: {api}; world: {save_world}")
    if kind == "full":
        way = pick(draw, ("dcp-full", "fsdp1-full")) if api == "fsdp1" else "dcp-full"
        # offload under FSDP1 on a CPU device breaks ranks (a recorded
        # finding; a hung rank costs a deadline): drawn now and then
        offload = maybe(draw, 1) if api == "fsdp2" else draw(ints(11)) == 11
        # a checkpoint of a model in use (one forward before it) and mixed
        # precision: the state dict is full precision all the same (FSDP1's
        # buffers too, which its forward cast to buffer_dtype)
        warm = maybe(draw, 1)
        precisions = [p for p in CKPT_PRECISIONS if api == "fsdp1" or not p.buffer_dtype]
        precision = pick(draw, precisions) if maybe(draw, 1) else None
        event(f"full state dict: warm {warm}, precision {precision is not None}")
        ck = CheckpointPlan(
            save_world=save_world, full_sd=way, offload=offload,
            rank0_only=way == "fsdp1-full" and maybe(draw, 1),
            ignore_frozen=way == "dcp-full" and maybe(draw, 1),
            warm=warm, precision=precision,
        )
        return dataclasses.replace(spec, ckpt=ck)
    if kind == "ties":
        paths = LOAD_PATHS if api == "fsdp2" else tuple(p for p in LOAD_PATHS if p != "set_model_state_dict-broadcast")
        path = pick(draw, paths)
        event(f"load path: {path}")
        if api == "fsdp1" and not spec.plan.use_orig_params:
            # with use_orig_params=False FSDP1's parameters are flat: no
            # per-name Parameter to tie
            spec = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, use_orig_params=True))
        # a load into a model that has run (lazy init done): where the load
        # happens after wrapping (not meta init, not FSDP1's assign before it)
        warm = path != "meta-to_empty" and not (api == "fsdp1" and path == "load_state_dict-assign") and maybe(draw, 1)
        # under mixed precision: the load reaches the full-precision
        # parameters, and the next forward computes (in param_dtype) with them
        precision = pick(draw, [p for p in CKPT_PRECISIONS if api == "fsdp1" or not p.buffer_dtype]) if maybe(draw, 1) else None
        event(f"load into a model that ran: {warm}, precision {precision is not None}")
        return dataclasses.replace(spec, ckpt=CheckpointPlan(save_world=save_world, load_path=path, warm=warm, precision=precision))
    load_api = pick(draw, (api, "fsdp2" if api == "fsdp1" else "fsdp1"))
    load_plan = draw_load_plan(draw, spec, load_api)
    load_world = pick(draw, WORLDS)
    ck = CheckpointPlan(
        save_world=save_world, load_world=load_world, load_plan=load_plan, optimizer=pick(draw, CKPT_OPTIMIZERS),
        steps=1 + draw(ints(1)), steps_after=draw(ints(2 if kind == "optim" else 1)),
    )
    if kind == "optim":
        # requires_grad flipped after the first step: FSDP2, or FSDP1 with
        # use_orig_params=True (its original parameters are the ones the
        # user freezes; with use_orig_params=False they are views of a flat
        # parameter whose requires_grad the wrap fixed)
        if (api == "fsdp2" or spec.plan.use_orig_params) and maybe(draw, 1):
            ck = dataclasses.replace(ck, refreeze=tuple(pick_subset(draw, canon, min_size=1, max_size=2)))
        if maybe(draw, 2):
            ck = dataclasses.replace(ck, load_frozen=tuple(pick_subset(draw, canon, min_size=0, max_size=len(canon))))
    out = dataclasses.replace(spec, ckpt=ck)
    if not _fits(out):
        # a load plan FSDP1 rejects for the load-time mask: the case's own
        # plan, use_orig_params=True (mixed units warn, not fail)
        fallback = spec.plan if load_api == api else WrapPlan(api=load_api, use_orig_params=True)
        if fallback.api == "fsdp1":
            fallback = dataclasses.replace(fallback, use_orig_params=True)
        out = dataclasses.replace(spec, ckpt=dataclasses.replace(ck, load_plan=fallback))
    if out.ckpt.steps_after and not _trains_after_load(out):
        # the FSDP1 load side holds what FSDP1's training cases leave out (a
        # module under two names, a tie across units, a container unit:
        # recorded findings corrupt its training, see training_specs): the
        # load is checked, training after it is not
        out = dataclasses.replace(out, ckpt=dataclasses.replace(out.ckpt, steps_after=0))
        event("resume: no steps (FSDP1 load side not trainable)")
    if per_parameter(out) and maybe(draw, 1):
        # the optimizer as training scripts build it: matrices, and the rest
        # at another learning rate without weight decay (one of them empty
        # where the model has no parameter of that kind)
        out = dataclasses.replace(out, ckpt=dataclasses.replace(out.ckpt, param_groups=2))
    event(f"load: {out.ckpt.load_plan.api} on {load_world}; optimizer {ck.optimizer}, {out.ckpt.param_groups} param group(s)")
    if out.ckpt.refreeze or out.ckpt.load_frozen is not None:
        event("freeze change")
    return out


def checkpoint_specs(kind: str, *, api: str | None = None, max_modules: int = 8) -> SearchStrategy[CaseSpec]:
    """Checkpoint cases for one invariant family: ``full`` (SD-FULL: how the
    full state dict is taken, of a model that ran a forward or not, under
    mixed precision or not), ``ties`` (TIES-KEPT: a load path, into a model
    that ran a forward or not, under mixed precision or not; cases with ties
    or shared modules), ``reshard`` (CKPT-RESHARD: save and load plans
    and world sizes, optimizer and its param_groups) and ``optim``
    (OPTIM-STATE: as reshard, plus requires_grad changes before the save and
    at the load). Trees have
    dimensions 1..8, so world sizes 2 and 3 give uneven and empty shards.
    ``api``: the API the case is saved under ("fsdp1" or "fsdp2"; it may
    load under the other); None draws it."""
    if kind not in KINDS:
        raise InvalidArgument(f"kind={kind!r} must be one of {KINDS}")
    if api not in (None, "fsdp1", "fsdp2"):
        raise InvalidArgument(f"api={api!r} must be None, 'fsdp1' or 'fsdp2'")
    check_int(max_modules, "max_modules", min_value=1)
    apis = ("fsdp2", "fsdp1") if api is None else (api,)
    bases = {a: _bases(a, max_modules, kind == "ties") for a in apis}
    return _checkpoint_specs(kind, bases).filter(_fits)
