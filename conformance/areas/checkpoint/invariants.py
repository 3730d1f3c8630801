"""Checkpoint invariants: full state dicts (SD-FULL), ties through every load
path (TIES-KEPT), torch.distributed.checkpoint across plans, APIs and world
sizes (CKPT-RESHARD) and optimizer state through a save and load
(OPTIM-STATE)."""

from __future__ import annotations

import dataclasses
import math

import torch

from conformance.areas.checkpoint.observation import CkptObservation
from conformance.areas.checkpoint.oracle import CkptPrediction
from conformance.areas.common.catalog import VALUES_UNCHECKED, Catalog, NotChecked
from conformance.areas.common.fsdp2_oracle import container_given_to_fully_shard as given
from conformance.areas.common.fsdp2_oracle import list_group_tags, predict_fsdp2, rerun_group_lost_params
from conformance.areas.common.training import TRAIN_ATOL, TRAIN_RTOL
from conformance.areas.common.violations import fsdp1_cause_tags, violation
from conformance.case.model_case import is_model_case
from conformance.case.spec import CaseSpec
from conformance.case.target import graph_of
from conformance.case.violation import Violation, set_diff

catalog = Catalog()

DOC_DCP_SD = "torch.distributed.checkpoint.state_dict: StateDictOptions, get_model_state_dict / get_optimizer_state_dict / set_state_dict docstrings"
DOC_DCP = "torch.distributed.checkpoint save / load docstrings (load-time resharding: 'supports loading into a different world size')"
DOC_FSDP1_SD = "FullyShardedDataParallel.state_dict_type / FullStateDictConfig (offload_to_cpu, rank0_only) / SHARDED_STATE_DICT docstrings"
DOC_MP = ("MixedPrecision docstring (param_dtype: 'for model checkpointing, the parameters are always saved in full precision'; "
          "buffer_dtype: cast 'in the first forward pass and keeps them in that dtype thereafter. For model checkpointing, "
          "the buffers are saved in full precision except for LOCAL_STATE_DICT'); MixedPrecisionPolicy docstring (the sharded parameters stay in the original dtype)")
DOC_FSDP2 = "fully_shard docstring (parameters are DTensors; meta-device init then to_empty); torch.nn.Module.load_state_dict (assign)"


def case_tags(spec: CaseSpec, pred: CkptPrediction | None = None) -> set[str]:
    """Facts about a checkpoint case that known_failures.toml entries match on."""
    ck = spec.ckpt
    load = ck.load_plan or spec.plan
    tags = {f"api:{spec.plan.api}", f"load-api:{load.api}", f"world:{ck.save_world}", f"load-world:{ck.load_world}",
            f"optim:{ck.optimizer}", f"way:{ck.full_sd}", f"load:{ck.load_path}"}
    if spec.plan.api == "fsdp1":
        tags.add(f"uop:{str(spec.plan.use_orig_params).lower()}")
        kwargs = getattr(spec.plan.policy, "kwargs", ())
        if any(t and k == "sharding_strategy" and v == "NO_SHARD" for t, kw in kwargs for k, v in kw):
            tags.add("no-shard-unit")  # a unit of its own sharding strategy: NO_SHARD (the root's kwargs are the root's)
    if load.api == "fsdp1":
        tags.add(f"load-uop:{str(load.use_orig_params).lower()}")
    for flag in ("rank0_only", "offload", "ignore_frozen"):
        if getattr(ck, flag):
            tags.add(flag)
    if ck.param_groups > 1:
        tags.add(f"param-groups:{ck.param_groups}")  # the round trip's optimizer: matrices, and the rest at another lr
        if pred is not None and pred.empty_group:
            # no matrix: the first group is empty (not-last); matrices only: the second (last)
            tags.add(f"param-groups:empty-{pred.empty_group}")
    if ck.precision is not None:
        tags.add(f"precision:{ck.precision.param_dtype or 'none'}")
        if ck.precision.buffer_dtype:
            tags.add(f"buffer_dtype:{ck.precision.buffer_dtype}")
    if not ck.warm:
        tags.add("before-first-forward")  # SD-FULL: the state dict; TIES-KEPT: the load
    if ck.warm:
        tags.add("forward-first")  # SD-FULL: a forward, no backward, before the state dict; TIES-KEPT: before the load
        if spec.plan.api == "fsdp2" and _group_unsharded_after_forward(spec):
            # a group that does not reshard after forward (the root's
            # reshard_after_forward None -> False, or False given): its
            # unsharded parameters stay registered
            tags.add("group-unsharded-after-forward")
    # a real model's ties and shared modules are in its graph, not its case
    shared = bool(spec.shared) or (is_model_case(spec) and graph_of(spec).shared_modules())
    if spec.ties or shared or (is_model_case(spec) and pred is not None and pred.tied):
        tags.add("tie")
    if shared:
        tags.add("shared-module")
    if _tie_in_unresharded_list_group(spec):
        tags.add("group:multi-no-reshard-tie-reversed")
    if container_given_to_fully_shard(spec, load):
        tags.add("container-subclass")  # a ModuleList/ModuleDict subclass with a forward, given to fully_shard
    if spec.plan.api == "fsdp2" and not is_model_case(spec):
        # the save's training: a list group whose last module's output needs
        # no gradient (fsdp2-frozen-list-group-freed-in-backward), or one of
        # whose modules runs again after a frozen Embedding completed it
        # (fsdp2-list-group-reentered-loses-grad)
        tags |= list_group_tags(spec, predict_fsdp2(spec, torch.__version__))
    if pred is not None:
        if any(len(group) > 2 for group in pred.tied):
            tags.add("aliases:3+")  # one Parameter under three or more names
        if any(len({n.rpartition(".")[0] for n in group}) < len(group) for group in pred.tied):
            tags.add("tie:same-module")  # one module holds a Parameter under two of its names
        if set(pred.untrained_at_save) - set(pred.frozen_at_load):
            # trains after the load, but had no optimizer state at the save
            tags.add("unfrozen-at-load")
        if pred.optim_empty_at_save:
            tags.add("optim-empty-at-save")
        elif trainable_without_state(spec, pred):
            tags.add("save:trainable-without-state")  # fsdp1-optim-state-dict-trainable-param-without-state's mechanism
        if not is_model_case(spec) and _list_group_completed_by_embedding_frozen_at_load(spec, pred):
            tags.add("group:multi-frozen-embedding-after-load")
        if not is_model_case(spec) and _list_group_completed_by_embedding_refrozen_before_save(spec, pred):
            tags.add("group:multi-frozen-embedding")
        if pred.nothing_trains_first:
            tags.add("nothing-trains-first")
            if spec.plan.api == "fsdp2" and _refreeze_in_unsharded_group(spec):
                tags.add("refreeze:unsharded-group")
            if spec.plan.api == "fsdp1" and spec.plan.use_orig_params and (
                    spec.ckpt.steps > 1 or (spec.ckpt.steps_after and not pred.mask_changes)):
                # every unit ran the first step's forward all frozen, with no
                # backward after it, and the refreeze unfreezes a parameter
                # that a later step of the same model trains: the save's
                # second step, or the uninterrupted run after the save (FSDP1
                # continues only under the save's mask)
                # (fsdp1-unfreeze-frozen-unit-orig-params' mechanism, the
                # schedule area's tag of the same name)
                tags.add("unit:stale-hook-state")
        if pred.uneven_steps_in_load_unit:
            tags.add("load-unit:uneven-steps")
        if pred.fsdp1_paramless_root:
            tags.add("root-unit:no-params")
        if pred.no_backward_before_save:
            tags.add("no-backward-before-save")
        if pred.frozen:
            tags.add("frozen")
        if pred.frozen_at_load:
            tags.add("load-frozen")  # the model the checkpoint is loaded into and trained on freezes some parameter
        if pred.mask_changes:
            tags.add("mask-change")
        tags |= {f"shard:{x}" for x in pred.shards}
    return tags


def container_given_to_fully_shard(spec: CaseSpec, load) -> bool:
    """The save side or the load side is FSDP2 and gives fully_shard a
    container subclass with a forward."""


    return any(p.api == "fsdp2" and given(dataclasses.replace(spec, plan=p)) for p in (spec.plan, load))


def _tie_in_unresharded_list_group(spec: CaseSpec) -> bool:
    """The save plan's fully_shard([b, a, ...], reshard_after_forward=False),
    whose first listed module is not the first of its modules that the
    state dict's traversal reaches, holds both ends of a tied Parameter
    (fsdp2-tied-list-group-unsharded-save-segfault: FSDP2's state-dict hook
    sits on the first listed module). The traversal visits every name,
    a shared module's too: listed in registration order, [proj0, proj1]
    with proj1 also registered earlier under another parent is reached
    proj1 first (thorough seed 914417134, torch 2.13.0: the save
    segfaulted)."""
    if spec.plan.api != "fsdp2" or is_model_case(spec):
        # a real model's ties are not (module, source) pairs of its case:
        # not told (a match this tag needs then stays a FAIL)
        return False

    def under(path: str, mods) -> bool:
        return any(path == m or path.startswith(m + ".") or m == "" for m in mods)

    graph = graph_of(spec)
    # node id -> when Module.state_dict's recursion (every name, pre-order) first reaches it
    order = {nid: i for i, (_, nid) in enumerate(graph.named_modules())}
    for g in spec.plan.groups:
        if len(g.modules) > 1 and g.reshard_after_forward is False:
            listed = [order.get(graph.resolve_module(m), -1) for m in g.modules]
            if listed == sorted(listed):
                continue  # given in registration order: saves (checked, torch 2.13.0)
            for t in spec.ties:
                if under(t.module, g.modules) and under(t.source.rpartition(".")[0], g.modules):
                    return True
    return False


def _outside(pred: CkptPrediction, obs: CkptObservation) -> NotChecked:
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    return NotChecked(f"this torch cannot run it: {obs.skipped}")


def _raised(inv: str, obs: CkptObservation | list[CkptObservation], tags: set[str], pred: CkptPrediction | None = None,
            lost: frozenset[str] = frozenset(), spec: CaseSpec | None = None) -> list[Violation] | NotChecked:
    """One violation per distinct error (ranks may raise differently).
    ``lost``: the parameters whose gradient the save's training loses
    (_rerun_group_params)."""
    aliases = {a for group in pred.tied for a in group[1:]} if pred is not None else set()
    firsts = {group[0] for group in pred.tied} if pred is not None else set()
    unstated = trainable_without_state(spec, pred) if pred is not None and spec is not None else frozenset()
    out, seen = [], set()
    for o in obs if isinstance(obs, list) else [obs]:
        if not o.error or (o.phase, o.error) in seen:
            continue
        seen.add((o.phase, o.error))
        etype = o.error.split(":")[0]
        where = "rank:0" if o.rank == 0 else "rank:nonzero"
        out.append(violation(inv, f"rank {o.rank}: {o.phase} raised {o.error}", tags, "kind:raised", f"phase:{o.phase}", f"error:{etype}", where,
                      *cause_tags(o.error, aliases, firsts, lost, unstated)))
    return out


def trainable_without_state(spec: CaseSpec, pred: CkptPrediction) -> frozenset[str]:
    """FSDP1 with use_orig_params=True: every name of the parameters that
    require a gradient at the save but have no optimizer state there (the
    refreeze unfroze them after the only step, or they trained in no step),
    where some other parameter has state. FSDP1's optimizer state dict
    gathers a unit's state by the unit's parameters that require a gradient
    and raises for one without state ('<FQN> is not in the optimizer state':
    fsdp1-optim-state-dict-trainable-param-without-state)."""
    if spec.plan.api != "fsdp1" or not spec.plan.use_orig_params or is_model_case(spec) or pred.optim_empty_at_save:
        return frozenset()
    names = set(pred.untrained_at_save) - set(pred.frozen_at_save)
    for group in pred.tied:
        if names & set(group):
            names |= set(group)
    return frozenset(names)


def _rerun_group_params(spec: CaseSpec, pred: CkptPrediction) -> frozenset[str]:
    """Every name of the trainable parameters of the save plan's FSDP2 list
    groups that run forward again after a frozen Embedding completed them
    (group:rerun-after-frozen-embedding): the save's training loses their
    gradient (fsdp2-list-group-reentered-loses-grad), so that they end the
    training without optimizer state where single-process training gives
    them some (thorough seed 2902025126, torch 2.13.0: fully_shard([embed1,
    layers0.0]) with layers0 registered twice; the load asked for
    "optim.state.layers0.0.weight.momentum_buffer", which the save lacked)."""
    if spec.plan.api != "fsdp2" or is_model_case(spec):
        return frozenset()
    lost = rerun_group_lost_params(spec, predict_fsdp2(spec, torch.__version__).groups)
    return frozenset(n for group in pred.tied if group[0] in lost for n in group) | lost


def _diff_tags(diff) -> tuple[str, ...]:
    """optim-diff:step: of the optimizer state only the "step" counts differ."""
    return ("optim-diff:step",) if diff and all(k.endswith(".step") for k in diff) else ()


def _canon(pred: CkptPrediction) -> dict[str, str]:
    """Every name of a Parameter that has several -> its first name."""
    return {a: group[0] for group in pred.tied for a in group}


def _renamed_tags(pred: CkptPrediction, obs: CkptObservation) -> tuple[str, ...]:
    """params:renamed-alias: the groups differ only in which of a shared
    Parameter's names they list (the same Parameters, other names)."""
    if not obs.groups_params:
        return ()
    canon = _canon(pred)
    same = all({canon.get(n, n) for n in got} == {canon.get(n, n) for n in want} for _, got, want in obs.groups_params)
    return ("params:renamed-alias",) if same else ()


def _group_unsharded_after_forward(spec: CaseSpec) -> bool:
    """Whether a group that manages parameters keeps them unsharded after
    forward (reshard_after_forward False in effect: given, or the root's
    default)."""
    import torch

    from conformance.areas.common.fsdp2_oracle import predict_fsdp2

    return any(g.managed and not g.reshard for g in predict_fsdp2(spec, torch.__version__).groups)


def _list_group_completed_by_embedding_frozen_at_load(spec: CaseSpec, pred: CkptPrediction) -> bool:
    """The training after the save (the save side's continued run under its
    own plan, and the load side's resume under the load plan), both under
    the mask at load: an FSDP2 list group completed by an Embedding frozen
    then (fsdp2-frozen-list-group-freed-in-backward's mechanism; the save's
    own training is group:multi-frozen-embedding)."""
    from conformance.areas.common.fsdp2_oracle import list_group_completed_by_frozen_embedding

    frozen = set(pred.frozen_at_load)
    plans = {p for p in (spec.plan, spec.ckpt.load_plan or spec.plan) if p.api == "fsdp2"}  # one when the load keeps the plan
    cases = [dataclasses.replace(spec, plan=plan) for plan in plans]
    return any(list_group_completed_by_frozen_embedding(case, predict_fsdp2(case, torch.__version__).groups, frozen) for case in cases)


def _list_group_completed_by_embedding_refrozen_before_save(spec: CaseSpec, pred: CkptPrediction) -> bool:
    """The save's own training after its first step, under the mask the
    plan's refreeze leaves (the mask at the save): an FSDP2 list group
    completed by an Embedding frozen then (fsdp2-frozen-list-group-freed-in-
    backward's mechanism, as group:multi-frozen-embedding names it for the
    case's own mask; ci seed 9177: fully_shard([proj2, embed3]) with
    embed3.weight tied to proj2.weight, refrozen after step 0, "train raised
    RuntimeError: setStorage ... storage of size 0" at step 1)."""
    from conformance.areas.common.fsdp2_oracle import list_group_completed_by_frozen_embedding

    if spec.plan.api != "fsdp2" or not spec.ckpt.refreeze or spec.ckpt.steps < 2:
        return False
    groups = predict_fsdp2(spec, torch.__version__).groups
    return list_group_completed_by_frozen_embedding(spec, groups, set(pred.frozen_at_save))


def _refreeze_in_unsharded_group(spec: CaseSpec) -> bool:
    """A parameter the plan unfreezes after the first step lives in an FSDP2
    group that keeps its parameters unsharded after forward
    (reshard_after_forward False in effect: given, or the root's default).
    With nothing trainable in that first step there is no backward to
    reshard them, so requires_grad_ reaches the registered unsharded
    Parameter, not the sharded one the optimizer holds
    (fsdp2-frozen-root-forward-leaves-params-unsharded)."""
    g = graph_of(spec)
    unfrozen = {g.param_fqn[g.resolve_param(f)] for f in spec.ckpt.refreeze}
    return any(grp.managed and not grp.reshard and unfrozen & set(grp.managed) for grp in predict_fsdp2(spec, torch.__version__).groups)


def cause_tags(error: str, aliases=frozenset(), firsts=frozenset(), lost=frozenset(), unstated=frozenset()) -> tuple[str, ...]:
    """What a CheckpointException wraps (the adapter writes 'CheckpointException:
    rank R: InnerType: message'): its type, and which of DCP's load-plan
    checks it is, so that a finding matches one cause, not every
    CheckpointException. For a missing key or a size mismatch, the key it
    names (key:model, key:optim-state, key:param-groups) and key:alias when
    its FQN is not the first of a Parameter's names (``aliases``: those
    other names; ``firsts``: the first names of Parameters that have several);
    key:lost-grad when its FQN is one of ``lost`` (_rerun_group_params)."""
    if "out of bounds for storage of size 0" in error:
        return ("cause:freed-storage",)  # a parameter read over its freed unsharded storage
    if "its data is not allocated yet" in error:
        return ("cause:data-not-allocated",)  # a freed (resized to 0) unsharded parameter used as it is
    if "_post_backward_hook_state" in error:
        return ("cause:post-backward-hook-state",)  # FSDP1's stale post-backward hook state of a unit
    if fsdp1_cause_tags(error):
        # FSDP1 re-registering a tied (shared) parameter whose primary was left a plain Tensor view
        return tuple(sorted(fsdp1_cause_tags(error)))
    if "got mixed torch.Tensor and DTensor" in error or "placement changes are not supported" in error:
        # load_state_dict copying a DTensor into a registered plain (unsharded)
        # tensor, or into a DTensor of another placement
        return ("cause:copy-into-unsharded",)
    head, sep, rest = error.partition(": rank ")
    if head != "CheckpointException" or not sep:
        return _optim_conversion_tags(error, aliases, firsts, unstated)
    inner = rest.partition(": ")[2]
    itype, _, msg = inner.partition(": ")
    tags = [f"cause:{itype}"]
    if msg.startswith("Missing key in checkpoint state_dict"):
        tags.append("cause:missing-key")
        key = msg.partition(": ")[2].strip().rstrip(".")
    elif msg.startswith("Size mismatch between saved"):
        tags.append("cause:size-mismatch")
        key = msg.rpartition(" for ")[2].strip()
    else:
        return tuple(tags)
    # the key it names: model or optimizer state of which FQN
    fqn = None
    if key.startswith("optim.state."):
        tags.append("key:optim-state")
        fqn = key[len("optim.state."):].rpartition(".")[0]  # less the state's own key (momentum_buffer, step)
    elif key.startswith("optim.param_groups"):
        tags.append("key:param-groups")
    elif key.startswith("model."):
        tags.append("key:model")
        fqn = key[len("model."):]
    if fqn is not None and fqn in aliases:
        tags.append("key:alias")
    if fqn is not None and fqn in lost:
        tags.append("key:lost-grad")
    return tuple(tags)


def _optim_conversion_tags(error: str, aliases, firsts=frozenset(), unstated=frozenset()) -> tuple[str, ...]:
    """FSDP1's optimizer state dict (use_orig_params=True) looks each of a
    unit's parameters up by its name inside the unit: 'RuntimeError: <FQN> is
    not in the optimizer state. The FSDPParamInfo has the param keys ...'.
    cause:not-in-optim-state, and key:alias when that FQN is not the
    Parameter's first name. A bare KeyError naming the first name of a
    Parameter that has several (FSDP1, use_orig_params=False, knows it only by
    its name inside the unit that flattened it: optim_state_dict_to_load's
    rekeying of the param_groups): key:first-of-shared (error:KeyError says
    the type). key:trainable-without-state when the FQN is one of
    ``unstated`` (trainable_without_state)."""
    itype, _, msg = error.partition(": ")
    if itype == "KeyError":
        key = msg.strip()
        if len(key) > 1 and key[0] == key[-1] and key[0] in "'\"":
            key = key[1:-1]
        return ("key:first-of-shared",) if key in firsts else ()
    fqn, sep, _ = msg.partition(" is not in the optimizer state")
    if itype != "RuntimeError" or not sep or " " in fqn:
        return ()
    return ("cause:not-in-optim-state", *(("key:alias",) if fqn in aliases else ()),
            *(("key:trainable-without-state",) if fqn in unstated else ()))


@catalog.invariant(
    "SD-FULL",
    group="checkpoint",
    api="fsdp1|fsdp2",
    scenario="ckpt-full",
    all_ranks=True,
    statement="A full model state dict (FSDP1 FULL_STATE_DICT incl. rank0_only / offload_to_cpu; get_model_state_dict(full_state_dict=True) incl. cpu_offload) holds exactly the unwrapped model's keys and values as plain tensors in their dtypes (with ignore_frozen_params: no frozen parameter); ranks that rank0_only / cpu_offload leave out get an empty dict. So too after a forward and under mixed precision (MixedPrecision / MixedPrecisionPolicy: parameters saved in full precision; FSDP1's buffers, cast to buffer_dtype by the first forward, saved in full precision at the values that cast left).",
    source=f"{DOC_FSDP1_SD}; {DOC_DCP_SD} (full_state_dict, cpu_offload: 'only the rank0 will get the state_dict', ignore_frozen_params); {DOC_MP}",
)
def check_full(spec: CaseSpec, pred: CkptPrediction, obs: list[CkptObservation]) -> list[Violation] | NotChecked:
    if pred.applicable or obs[0].skipped:
        return _outside(pred, obs[0])
    tags = case_tags(spec, pred)
    if any(o.error for o in obs):
        return _raised("SD-FULL", obs, tags, pred, spec=spec)
    frozen = set(pred.frozen) if spec.ckpt.ignore_frozen else set()
    want = set(pred.sd_keys) - frozen
    out = []
    for o in obs:
        if pred.rank0_only and o.rank != 0:
            if o.keys:
                # keys:buffers-only: the rank got only buffers, no parameter
                only = ("keys:buffers-only",) if set(o.keys) <= set(pred.buffers) else ()
                out.append(violation("SD-FULL", f"rank {o.rank} got {len(o.keys)} keys, expected an empty dict: {sorted(o.keys)[:6]}", tags, "kind:nonzero-rank-keys", *only))
            continue
        got = set(o.keys)
        if got != want:
            # which frozen names were kept: only second names of tied / shared
            # parameters (their first name dropped), or any
            second_names = {a for group in pred.tied for a in group[1:]}
            extra = got - want
            kind = ("kind:frozen-alias-kept" if extra <= second_names else "kind:frozen-kept") if frozen and extra <= frozen else "kind:keys"
            out.append(violation("SD-FULL", f"rank {o.rank}: keys {set_diff(got, want)}", tags, kind))
        if o.wrong_values and o.values_meaningful:
            # values:rounded-buffers: every wrong value is a buffer's, rounded through buffer_dtype
            rounded = ("values:rounded-buffers",) if set(o.wrong_values) <= set(o.rounded) & set(pred.buffers) else ()
            out.append(violation("SD-FULL", f"rank {o.rank}: values of {list(o.wrong_values)} differ from the unwrapped model's", tags, "kind:values", *rounded))
        if o.not_plain:
            out.append(violation("SD-FULL", f"rank {o.rank}: {list(o.not_plain)} are not plain (CPU) tensors", tags, "kind:not-plain"))
        if o.wrong_dtypes:
            # a dtype is structure: checked on every tier. dtype-keys:*: which
            # keys: only buffers; only buffers left in buffer_dtype, of units
            # that manage no parameter, nor does any unit enclosing them
            which = {k for k, _ in o.wrong_dtypes}
            low = {d for _, d in o.wrong_dtypes} == {pred.buffer_dtype}
            only = (("dtype-keys:buffers-only",) if which <= set(pred.buffers) else ()) + (
                ("dtype-keys:paramless-units",) if low and which <= set(pred.buffers_in_paramless_units) else ())
            out.append(violation("SD-FULL", f"rank {o.rank}: {dict(o.wrong_dtypes)} are not in the unwrapped model's dtype (full precision)",
                                 tags, "kind:dtype", *only))
    return out


@catalog.invariant(
    "TIES-KEPT",
    group="checkpoint",
    api="fsdp1|fsdp2",
    scenario="ckpt-ties",
    all_ranks=True,
    statement="Every load path (load_state_dict incl. assign=True, set_model_state_dict incl. broadcast_from_rank0, meta-device init + to_empty + load) loads the values and leaves tied names sharing one Parameter, with the parameter count unchanged; the first forward after the load computes with the loaded values (under mixed precision: as the same wrap of a model built with the loaded state computes, in param_dtype), whether or not the model ran a forward before the load.",
    source=f"{DOC_DCP_SD} (set_model_state_dict, broadcast_from_rank0); {DOC_FSDP2}; FullyShardedDataParallel param_init_fn",
)
def check_ties(spec: CaseSpec, pred: CkptPrediction, obs: list[CkptObservation]) -> list[Violation] | NotChecked:
    if pred.applicable or obs[0].skipped:
        return _outside(pred, obs[0])
    tags = case_tags(spec, pred)
    if any(o.error for o in obs):
        return _raised("TIES-KEPT", obs, tags, pred, spec=spec)
    out = []
    want = {group[0] for group in pred.tied}
    for o in obs:
        got = dict(o.ties)
        broken = sorted(c for c in want if got.get(c) is not True)
        if broken:
            out.append(violation("TIES-KEPT", f"rank {o.rank}: tied names of {broken} no longer share one Parameter", tags, "kind:untied"))
        if o.params_after != o.params_before:
            out.append(violation("TIES-KEPT", f"rank {o.rank}: {o.params_after} parameters after the load, {o.params_before} before", tags, "kind:param-count"))
        if o.wrong_values and o.values_meaningful:
            out.append(violation("TIES-KEPT", f"rank {o.rank}: {list(o.wrong_values)} do not hold the loaded values", tags, "kind:values"))
        if o.forward_loss is not None and o.values_meaningful:
            loss, ref = o.forward_loss
            if not (abs(loss - ref) <= TRAIN_ATOL + TRAIN_RTOL * abs(ref) or (math.isnan(loss) and math.isnan(ref))):
                out.append(violation("TIES-KEPT", f"rank {o.rank}: the first forward after the load gives loss {loss!r}, "
                                     f"the unwrapped model with the loaded state {ref!r}: FSDP computes with other values than it loaded",
                                     tags, "kind:forward-stale"))
    return out


@catalog.invariant(
    "CKPT-RESHARD",
    group="checkpoint",
    api="fsdp1|fsdp2",
    scenario="ckpt-roundtrip",
    statement="State saved with torch.distributed.checkpoint under one API, plan and world size loads under another (FSDP1 sharded <-> FSDP2, other wrap policy / grouping, world size 1, 2, 3) to the same model values, optimizer state and hyperparameters: each param group's as saved (a learning-rate schedule's step before the save; one group, or two as training scripts split them), whatever the load side built its optimizer with.",
    source=f"{DOC_DCP}; {DOC_DCP_SD} (get_state_dict / set_state_dict: 'can support different parallelisms, FSDP1, FSDP2'); {DOC_FSDP1_SD}",
)
def check_reshard(spec: CaseSpec, pred: CkptPrediction, obs: CkptObservation) -> list[Violation] | NotChecked:
    if pred.applicable or obs.skipped:
        return _outside(pred, obs)
    # the backend: values after a training step depend on its collectives
    # (fsdp2-gloo-reduce-scatter-avg-sums)
    tags = case_tags(spec, pred) | {f"backend:{obs.backend}"}
    if obs.error:
        return _raised("CKPT-RESHARD", obs, tags, pred, _rerun_group_params(spec, pred), spec=spec)
    if not obs.values_meaningful:
        return VALUES_UNCHECKED
    out = []
    if obs.model_diff:
        out.append(violation("CKPT-RESHARD", f"model values of {list(obs.model_diff)[:8]} differ from the saved ones", tags, "kind:model"))
    if obs.optim_diff:
        out.append(violation("CKPT-RESHARD", f"optimizer state {list(obs.optim_diff)[:8]} differs from the saved", tags, "kind:optim", *_diff_tags(obs.optim_diff)))
    if obs.groups_diff:
        renamed = [f"group {i}: {list(got)} for the saved {list(want)}" for i, got, want in obs.groups_params]
        out.append(violation("CKPT-RESHARD", f"param_groups differ from the saved: {list(obs.groups_diff)}" + (f" ({'; '.join(renamed)})" if renamed else ""),
                      tags, "kind:param-groups", *_renamed_tags(pred, obs)))
    return out


@catalog.invariant(
    "OPTIM-STATE",
    group="checkpoint",
    api="fsdp1|fsdp2",
    scenario="ckpt-roundtrip",
    statement="After a save and load every parameter that had optimizer state has exactly that state (keys and values), whatever its requires_grad at save and at load, a tied parameter one entry; training continued after the resume matches uninterrupted and single-process training.",
    source=f"{DOC_DCP_SD} (get_optimizer_state_dict / set_optimizer_state_dict); torch.optim.Optimizer.state_dict / load_state_dict; DESIGN.md OPTIM-STATE",
)
def check_optim(spec: CaseSpec, pred: CkptPrediction, obs: CkptObservation) -> list[Violation] | NotChecked:
    if pred.applicable or obs.skipped:
        return _outside(pred, obs)
    # the backend: values after a training step depend on its collectives
    # (fsdp2-gloo-reduce-scatter-avg-sums)
    tags = case_tags(spec, pred) | {f"backend:{obs.backend}"}
    if obs.error:
        return _raised("OPTIM-STATE", obs, tags, pred, _rerun_group_params(spec, pred), spec=spec)
    if not obs.values_meaningful:
        return VALUES_UNCHECKED
    out = []
    alias = {a: group[0] for group in pred.tied for a in group}
    frozen_save, frozen_load = set(pred.frozen_at_save), set(pred.frozen_at_load)

    def entries(names) -> dict[str, list[str]]:
        by: dict[str, list[str]] = {}
        for n in names:
            by.setdefault(alias.get(n, n), []).append(n)
        return by

    ref = set(obs.optim_ref)
    unstated = trainable_without_state(spec, pred)
    for what, names, kind in (("saved", obs.optim_saved, "save"), ("loaded", obs.optim_loaded, "load")):
        by = entries(names)
        for canon in sorted(ref - set(by)):
            extra = ["at-save:frozen" if canon in frozen_save else "at-save:trainable",
                     "at-load:frozen" if canon in frozen_load else "at-load:trainable"]
            if canon in _rerun_group_params(spec, pred):  # worked out only where a state is lost
                extra.append("param:lost-grad")  # its gradient lost in the save's training
            out.append(violation("OPTIM-STATE", f"{canon} had optimizer state; the {what} state has none", tags, f"kind:lost-at-{kind}", *extra))
        for canon in sorted(set(by) - ref):
            extra = ("param:trainable-without-state",) if canon in unstated else ()
            out.append(violation("OPTIM-STATE", f"{canon} has {what} optimizer state; single-process training gave it none", tags, f"kind:extra-at-{kind}", *extra))
        for canon, ns in sorted(by.items()):
            if len(ns) > 1:
                out.append(violation("OPTIM-STATE", f"tied parameter {canon} has {len(ns)} {what} state entries {ns}", tags, "kind:tie-entries"))
    if obs.optim_ref_diff:
        out.append(violation("OPTIM-STATE", f"saved optimizer state {list(obs.optim_ref_diff)[:8]} differs from single-process training's", tags, "kind:state-value"))
    if obs.optim_diff:
        out.append(violation("OPTIM-STATE", f"loaded optimizer state {list(obs.optim_diff)[:8]} differs from the saved", tags, "kind:state-changed", *_diff_tags(obs.optim_diff)))
    if obs.resume_ref_diff:
        # every parameter that differs had no state at the save (trainable, never stepped): state saved for
        # it anyway (an Adam step count) steps it otherwise than single-process training's first step
        extra = ("param:trainable-without-state",) if set(obs.resume_ref_diff) <= unstated else ()
        out.append(violation("OPTIM-STATE", f"after the resume {list(obs.resume_ref_diff)[:8]} differ from single-process training", tags,
                             "kind:resume-reference", *extra))
    if obs.resume_cont_diff:
        out.append(violation("OPTIM-STATE", f"after the resume {list(obs.resume_cont_diff)[:8]} differ from uninterrupted training", tags, "kind:resume-uninterrupted"))
    return out


def ranks_tags(spec: CaseSpec, pred: CkptPrediction, obs: list) -> set[str]:
    """A rank disagreement's facts: the case's tags (a known failure whose
    mechanism makes the ranks' state differ, such as a load's rank-dependent
    order of writes, is then KNOWN on it)."""
    return case_tags(spec, pred)


def failure_tags(spec: CaseSpec, pred: CkptPrediction, world_size: int) -> set[str]:
    """A HANG or CRASH of a checkpoint example: the case's tags, the
    oracle's facts included (a rank torch itself kills in a known code path
    is then KNOWN, not CRASH)."""
    return case_tags(spec, pred)


INVARIANTS = tuple(catalog.invariants)
