"""The oracle for the checkpoint invariants: what a full state dict holds,
which names are tied, which parameters carry optimizer state at the save.
Pure: reads the case's module graph (a CaseSpec's own, a ModelCase's
target's), never torch.distributed."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.areas.common.training_oracle import predict_training
from conformance.case.graph import ModelGraph
from conformance.case.model_case import is_model_case
from conformance.case.spec import CaseSpec, ModuleSpec, ParamSpec
from conformance.case.target import graph_of
from conformance.case.tree import join


@dataclass(frozen=True)
class CkptPrediction:
    applicable: str  # "" or why the case is outside what the APIs promise
    sd_keys: tuple[str, ...]  # the unwrapped model's state_dict keys (every alias)
    trainable: tuple[str, ...]  # parameter names (every alias) with requires_grad at the save
    frozen: tuple[str, ...]  # ... without
    buffers: tuple[str, ...]
    rank0_only: bool  # non-zero ranks get an empty full state dict
    tied: tuple[tuple[str, ...], ...]  # alias groups (canonical first) of tied / shared parameters
    frozen_at_save: tuple[str, ...]  # canonical FQNs frozen when the checkpoint is taken
    frozen_at_load: tuple[str, ...]  # canonical FQNs frozen at and after the load
    mask_changes: bool  # some parameter's requires_grad differs between save and load
    # "empty-save", "uneven-save", "empty-load", "uneven-load" (FSDP2 parameters, FSDP1 flat
    # parameters); "param-empty-save" / "-load": an FSDP1 parameter's dim-0 chunk is empty
    shards: tuple[str, ...] = ()
    # canonical FQNs no training step before the save trained: no optimizer
    # state at the save (frozen at every step before it)
    untrained_at_save: tuple[str, ...] = ()
    # no parameter trained before the save (the optimizer has no state yet)
    # while some parameter is trainable at the save
    optim_empty_at_save: bool = False
    # every parameter frozen in the first step (no backward), some unfrozen after it
    nothing_trains_first: bool = False
    # the load side is FSDP1 with flat parameters (use_orig_params=False) and
    # one of its units holds parameters that trained different numbers of
    # steps before the save (Adam's per-parameter "step" differs within a
    # flat parameter, which has one)
    uneven_steps_in_load_unit: bool = False
    # the save plan is FSDP1 and its root unit manages no parameter (every
    # parameter in a child unit); its buffers are the root's alone
    fsdp1_paramless_root: bool = False
    # every parameter is frozen in the last step before the save: its forward
    # runs no backward, so reshard_after_forward=False groups stay unsharded
    no_backward_before_save: bool = False
    # SD-FULL under FSDP1's MixedPrecision(buffer_dtype=...): that dtype;
    # after a forward, the buffer keys (every alias) the forward cast to it,
    # whose values the full precision state dict holds rounded through it
    # (MixedPrecision: buffers are cast in the first forward and kept in
    # buffer_dtype; checkpoints save them in full precision)
    buffer_dtype: str | None = None
    rounded_buffers: tuple[str, ...] = ()
    # the buffer keys whose unit and every enclosing unit manage no
    # parameter (a unit's state-dict hook returns early when it has none)
    buffers_in_paramless_units: tuple[str, ...] = ()
    # the round trip's optimizer has an empty param group: "not-last" (a
    # model without matrices: the first of its two groups), "last" (a model
    # of matrices only: the second), "" (none)
    empty_group: str = ""


@functools.lru_cache(maxsize=512)
def predict_ckpt(spec: CaseSpec) -> CkptPrediction:

    ck = spec.ckpt
    g = graph_of(spec)
    named = g.named_parameters(remove_duplicate=False)
    keys = tuple(g.state_dict_keys())
    params = {f for f, _ in named}
    buffers = tuple(k for k in keys if k not in params)
    trainable = tuple(f for f, pid in named if g.requires_grad(pid))
    frozen = tuple(f for f, pid in named if not g.requires_grad(pid))
    tied = tuple(tuple(g.aliases(pid)) for _, pid in g.named_parameters() if len(g.aliases(pid)) > 1)
    # by parameter id (the spec FQN where it was made), as the plan names them
    ids = [pid for _, pid in g.named_parameters()]
    at_save = {pid for pid in ids if not g.requires_grad(pid)} ^ set(ck.refreeze)
    at_load = at_save if ck.load_frozen is None else set(ck.load_frozen)
    # step 0 trains under the tree's mask, the later steps under the mask at the save
    initial = {pid for pid in ids if not g.requires_grad(pid)}
    untrained = initial & at_save if ck.steps > 1 else initial
    why = predict_training(spec).applicable
    if not why and ck.load_plan is not None:
        load = with_mask(dataclasses.replace(spec, plan=ck.load_plan, ckpt=None), at_load)
        why = predict_training(load).applicable
    rank0 = (ck.full_sd == "fsdp1-full" and ck.rank0_only) or (ck.full_sd == "dcp-full" and ck.offload)
    return CkptPrediction(
        applicable=why, sd_keys=keys, trainable=trainable, frozen=frozen, buffers=buffers, rank0_only=rank0,
        tied=tied, frozen_at_save=tuple(sorted(g.param_fqn[p] for p in at_save)),
        frozen_at_load=tuple(sorted(g.param_fqn[p] for p in at_load)),
        mask_changes=at_save != at_load, shards=_shards(spec, g, at_load),
        untrained_at_save=tuple(sorted(g.param_fqn[p] for p in untrained)),
        optim_empty_at_save=untrained == set(ids) and bool(set(ids) - at_save),
        nothing_trains_first=initial == set(ids) and bool(ck.refreeze),
        uneven_steps_in_load_unit=_uneven_steps_in_load_unit(spec, g, initial, at_save, at_load),
        fsdp1_paramless_root=_fsdp1_paramless_root(spec),
        no_backward_before_save=(initial if ck.steps == 1 else at_save) >= set(ids),
        empty_group=_empty_group(ck.param_groups, [len(g.param_info[p].shape) >= 2 for p in ids]),
        **_rounded_buffers(spec, g, buffers),
    )


def _empty_group(groups: int, matrix: list[bool]) -> str:
    """Which of the round trip's two param groups has no parameter (see
    CkptPrediction.empty_group)."""
    if groups < 2:
        return ""
    return "not-last" if not any(matrix) else "last" if all(matrix) else ""


def matrix_names(spec: CaseSpec) -> frozenset[str]:
    """Every name (aliases included) of a parameter of dimension 2 or more:
    the first of the round trip's two param_groups (training scripts decay
    the matrices' weights, not biases, norms and scales)."""
    g = graph_of(spec)
    return frozenset(f for f, pid in g.named_parameters(remove_duplicate=False) if len(g.param_info[pid].shape) >= 2)


def _rounded_buffers(spec: CaseSpec, g: ModelGraph, buffers: tuple[str, ...]) -> dict:
    """FSDP1 casts every floating buffer of the wrapped model to its units'
    buffer_dtype in the root's first forward (the case's buffers are
    float32; no unit's class is one MixedPrecision leaves out, no policy
    gives a unit other kwargs for it): the buffers rounded after a forward
    (warm). Which buffers sit in units that manage no parameter, their own
    and every enclosing one."""
    ck = spec.ckpt
    pr = ck.precision if ck is not None else None
    if spec.plan.api != "fsdp1" or pr is None or not pr.buffer_dtype or not buffers:
        return {}
    out = {"buffer_dtype": pr.buffer_dtype, "rounded_buffers": buffers if ck.warm else ()}
    p1 = predict_fsdp1(dataclasses.replace(spec, ckpt=None))
    if p1.error is None:
        managed = {u.path: bool(u.managed) for u in p1.units}

        def enclosing(path: str) -> list[str]:
            return [u for u in managed if u == "" or path == u or path.startswith(u + ".")]

        def canonical(key: str) -> str:
            return g.module_path[g.resolve_module(key.rpartition(".")[0])]

        out["buffers_in_paramless_units"] = tuple(k for k in buffers if not any(managed[u] for u in enclosing(canonical(k))))
    return out


def _fsdp1_paramless_root(spec: CaseSpec) -> bool:

    if spec.plan.api != "fsdp1":
        return False
    p1 = predict_fsdp1(dataclasses.replace(spec, ckpt=None))
    return p1.error is None and any(u.path == "" and not u.managed for u in p1.units)


def _uneven_steps_in_load_unit(spec: CaseSpec, g: ModelGraph, initial: set[str], at_save: set[str], at_load: set[str]) -> bool:
    """Step 0 trains what the tree leaves trainable, steps 1.. what is
    trainable at the save: does an FSDP1 flat-parameter unit of the load plan
    hold parameters with different (non-zero) step counts?"""

    ck = spec.ckpt
    load = ck.load_plan or spec.plan
    if load.api != "fsdp1" or load.use_orig_params:
        return False
    steps = {pid: (pid not in initial) + (ck.steps - 1) * (pid not in at_save) for _, pid in g.named_parameters()}
    p1 = predict_fsdp1(with_mask(dataclasses.replace(spec, plan=load, ckpt=None), at_load))
    if p1.error is not None:
        return False
    for u in p1.units:
        counts = {steps[g.resolve_param(f)] for f in u.managed} - {0}
        if len(counts) > 1:
            return True
    return False


def _chunks(n: int, world: int) -> tuple[bool, bool]:
    """(some rank's shard is empty, shards are uneven) for n rows / elements
    chunked over ``world`` ranks as torch.chunk does (FSDP2 dim 0, FSDP1's
    padded flat parameter)."""
    if world == 1:
        return False, False
    size = -(-n // world)
    return size * (world - 1) >= n, n % world != 0


def _shards(spec: CaseSpec, g: ModelGraph, at_load: set[str]) -> tuple[str, ...]:

    ck = spec.ckpt
    out = []
    for side, plan, world, frozen in (("save", spec.plan, ck.save_world, None), ("load", ck.load_plan or spec.plan, ck.load_world, at_load)):
        if plan.api == "fsdp2":
            sizes = [g.param_info[pid].shape[0] for _, pid in g.named_parameters()]
        else:
            case = dataclasses.replace(spec, plan=plan, ckpt=None)
            case = case if frozen is None else with_mask(case, frozen)
            p1 = predict_fsdp1(case)
            units = p1.units if p1.error is None else ()
            sizes = [sum(g.numel(g.resolve_param(f)) for f in u.managed) for u in units if u.managed]
        flags = [_chunks(n, world) for n in sizes]
        if any(e for e, _ in flags):
            out.append(f"empty-{side}")
        if any(u for _, u in flags):
            out.append(f"uneven-{side}")
        if plan.api == "fsdp1" and any(_chunks(g.param_info[pid].shape[0], world)[0] for _, pid in g.named_parameters()):
            # FSDP1's sharded state dict chunks each parameter along dim 0 as
            # torch.chunk does (as FSDP2 shards): some rank's chunk is empty
            out.append(f"param-empty-{side}")
    return tuple(out)


def with_mask(case, frozen) -> CaseSpec:
    """``case`` with exactly the parameters ``frozen`` (parameter ids: a
    CaseSpec's spec FQNs, a ModelCase's canonical FQNs) frozen."""
    frozen = frozenset(frozen)
    if is_model_case(case):
        g = graph_of(case)
        return dataclasses.replace(case, frozen=tuple(g.param_fqn[pid] for _, pid in g.named_parameters() if pid in frozen))
    return dataclasses.replace(case, tree=with_frozen(case.tree, frozen))


def with_frozen(tree: ModuleSpec, frozen: frozenset[str] | None, prefix: str = "") -> ModuleSpec:
    """``tree`` with exactly ``frozen`` frozen (None: unchanged)."""
    if frozen is None:
        return tree
    params = tuple(ParamSpec(p.name, p.shape, join(prefix, p.name) not in frozen) for p in tree.params)
    children = tuple(with_frozen(c, frozen, join(prefix, c.name)) for c in tree.children)
    return dataclasses.replace(tree, params=params, children=children)
