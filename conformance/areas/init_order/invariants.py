"""INIT-ORDER, INIT-META, INIT-SYNC, INIT-DIVERGENT: FSDP1 and FSDP2
whatever the order of the user's actions around lazy initialisation,
meta-device init, rank-seeded models synchronised from rank 0, and a module
some ranks do not call."""

from __future__ import annotations

from conformance.areas.common.catalog import VALUES_UNCHECKED, Catalog, NotChecked
from conformance.areas.common.violations import backend_tag, freed_storage_tags, load_cause_tag, violation
from conformance.areas.init_order.observation import InitObservation
from conformance.areas.init_order.oracle import InitPrediction
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation

catalog = Catalog()

DOC_ORDER = ("fully_shard docstring (parameters are DTensors from sharding on; lazy init at the first forward; "
             "model.to() keeps them DTensors); FSDPModule.unshard docstring (async_op: a handle to wait on); "
             "torch.distributed.checkpoint.state_dict.get_model_state_dict; upstream test_fully_shard_init.py "
             "(test_fully_shard_is_root, optimizer before lazy init), test_fully_shard_state_dict.py, test_fsdp_misc.py")
DOC_META = ("fully_shard docstring (a module on the meta device: to_empty() then the user's init after sharding); "
            "FullyShardedDataParallel param_init_fn docstring; upstream test_fully_shard_init.py "
            "(test_meta_device_1d_init), test_fsdp_meta.py")
DOC_SYNC = ("FullyShardedDataParallel sync_module_states docstring (\"broadcast module parameters and buffers from rank 0\"); "
            "torch.distributed.checkpoint.state_dict.set_model_state_dict / StateDictOptions.broadcast_from_rank0 "
            "(rank 0's full state dict broadcast; a state dict holds no non-persistent buffer); upstream "
            "test_fsdp_misc.py (sync_module_states), test_fully_shard_state_dict.py (broadcast_from_rank0)")
DOC_DIVERGENT = ("fully_shard / FullyShardedDataParallel docstrings (gradients are the mean over ranks, as data-parallel "
                 "training's; no rule that every rank calls every module); pytorch#158719 (maintainers: FSDP2 assumes SPMD)")


def _tags(pred: InitPrediction, obs: list[InitObservation]) -> set[str]:
    tags = set(pred.tags) | {backend_tag(obs[0])}
    if pred.plan.meta and any(o.untied or o.untied_at_init for o in obs):
        tags.add("meta:untied")  # training ran on a model whose tie meta-device init broke
    if any(o.empty_shard for o in obs):
        tags.add("shard:empty")
    return tags


def error_tag(text: str) -> str:
    """The mechanism of an error, for findings to match on."""
    if "requires them to be on GPU" in text:
        return "error:sync-needs-gpu"
    if "Expected out tensor to have dtype" in text:
        return "error:out-dtype"
    cause = load_cause_tag(text)  # load_state_dict's cause (the adapter keeps it), as HSDP-SYNC tags it
    if cause:
        return cause
    if "Error(s) in loading state_dict" in text:
        return "error:load-state-dict"
    if "Timed out" in text:
        return "error:timeout"
    freed = freed_storage_tags(text)
    if freed:
        return freed.pop()  # a parameter read over its freed unsharded storage, or used freed
    return "error:other"


def _raised(inv: str, o: InitObservation, tags: set[str]) -> list[Violation]:
    for field, at in (("wrap_error", "at:wrap"), ("init_error", "at:init"), ("sync_error", "at:sync"),
                      ("action_error", "at:action"), ("step_error", "at:training")):
        text = getattr(o, field)
        if text:
            return [violation(inv, f"rank {o.rank}: {field.replace('_', ' ')}: {text}", tags, "kind:raised", at, error_tag(text))]
    return []


def _values(inv: str, checks, tags: set[str], kind: str, what: str) -> list[Violation]:
    return [violation(inv, f"{c.name} ({c.kind}) {what} (max diff {c.max_diff:.3g})", tags, kind, f"value:{c.kind}")
            for c in checks if not c.equal]


def _trajectory(inv: str, pred: InitPrediction, obs: list[InitObservation], tags: set[str]) -> list[Violation] | NotChecked:
    first = obs[0]
    if not first.values_meaningful:
        return VALUES_UNCHECKED
    if not first.ref_stable:
        return NotChecked("the single-process reference diverged: no tolerance judges its values")
    out = []
    for o in obs:
        if o.losses_close is False:
            out.append(violation(inv, f"rank {o.rank}: losses {list(o.losses)}, single-process {list(o.ref_losses)}", tags, "kind:loss"))
    out += _values(inv, first.final, tags, "kind:param", "differs from single-process training after the steps")
    return out


@catalog.invariant(
    "INIT-ORDER",
    group="init",
    api="fsdp1|fsdp2",
    scenario="init_order",
    all_ranks=True,
    statement="Whatever the order of the user's actions around FSDP's lazy initialisation (the optimizer built before or after the first forward; model.state_dict() or get_model_state_dict before any forward; FSDP2's unshard() or unshard(async_op=True).wait() before the first forward; FSDP2's model.to(float64) after fully_shard, the parameters staying DTensors of the new dtype; FSDP2's parameter registered anew between fully_shard and lazy init as an nn.Parameter computed from it, as DoRA does, which FSDP2 then trains), after meta-device init or a sync from rank 0, nothing raises and the losses and final parameters of a few optimizer steps equal single-process training's.",
    source=DOC_ORDER,
)
def check_order(spec: CaseSpec, pred: InitPrediction, obs: list[InitObservation]) -> list[Violation] | NotChecked:
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    if pred.plan.skip is not None:
        return NotChecked("a rank-divergent case: INIT-DIVERGENT judges it")
    tags = _tags(pred, obs)
    first = obs[0]
    if any(o.init_error or o.sync_error for o in obs):
        return NotChecked("meta-device init or the sync raised (INIT-META, INIT-SYNC): nothing trained")
    out = []
    for o in obs:
        out += _raised("INIT-ORDER", o, tags)
    if out:
        return out
    if first.dtype_kept is False:
        out.append(violation("INIT-ORDER", f"after model.to({pred.plan.dtype}) a parameter is no DTensor of {pred.plan.dtype}", tags, "kind:dtype"))
    got = _trajectory("INIT-ORDER", pred, obs, tags)
    return out + got if isinstance(got, list) else (out or got)


@catalog.invariant(
    "INIT-META",
    group="init",
    api="fsdp1|fsdp2",
    scenario="init_order",
    all_ranks=True,
    statement="A model built on torch.device('meta'), wrapped, then materialised (FSDP2: fully_shard, to_empty(device), the user's reset of every module's own parameters and buffers through the DTensor API; FSDP1: param_init_fn doing to_empty(recurse=False) and that reset) has, on every rank, each parameter sharded as fully_shard promises (Shard(0), the dim-0 chunk of this rank, empty where dim 0 is smaller than the world) and full values, and every module's buffers, equal to the non-meta model built from the same seed, even, uneven and empty shards alike; a tied Parameter stays one (its names agree after training).",
    source=DOC_META,
)
def check_meta(spec: CaseSpec, pred: InitPrediction, obs: list[InitObservation]) -> list[Violation] | NotChecked:
    if not pred.plan.meta:
        return NotChecked("the case is not initialised on the meta device")
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    tags = _tags(pred, obs)
    out = []
    for o in obs:
        if o.wrap_error or o.init_error:
            text = o.wrap_error or o.init_error
            out.append(violation("INIT-META", f"rank {o.rank}: {text}", tags, "kind:raised", "at:init", error_tag(text)))
        out += [violation("INIT-META", f"rank {o.rank}: {b}", tags, "kind:shard") for b in o.bad_shards]
    if out:
        return out
    if not obs[0].values_meaningful:
        # FSDP2's shards and placements were compared (structure): that holds on the fake tier
        return [] if spec.plan.api == "fsdp2" else VALUES_UNCHECKED
    out = [violation("INIT-META", f"tied names {list(obs[0].untied)} hold other values than the Parameter they alias after training: "
                     "meta-device init broke the tie", tags, "kind:untied")] if obs[0].untied else []
    if not out and obs[0].untied_at_init:
        out = [violation("INIT-META", "FSDP manages more elements than the tied model has parameters after meta-device init: "
                         "the tie broke at init", tags, "kind:untied")]
    return out + _values("INIT-META", obs[0].meta_values, tags, "kind:meta-value", "differs from the non-meta model of the same seed")


@catalog.invariant(
    "INIT-SYNC",
    group="init",
    api="fsdp1|fsdp2",
    scenario="init_order",
    all_ranks=True,
    statement="Every rank built from its own seed, FSDP1 with sync_module_states=True and FSDP2 with set_model_state_dict(rank 0's full state dict, full_state_dict=True, broadcast_from_rank0=True) leave every rank with rank 0's parameters and persistent buffers, those of every module (the root's, a unit's and the modules' under a unit); FSDP1 with rank 0's non-persistent buffers too (its docstring says buffers, all of them); FSDP2's non-persistent buffers are outside a state dict and not compared.",
    source=DOC_SYNC,
)
def check_sync(spec: CaseSpec, pred: InitPrediction, obs: list[InitObservation]) -> list[Violation] | NotChecked:
    if not pred.plan.sync:
        return NotChecked("the case's ranks start from the same values")
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    tags = _tags(pred, obs)
    out = []
    for o in obs:
        if o.wrap_error or o.sync_error:
            text = o.wrap_error or o.sync_error
            out.append(violation("INIT-SYNC", f"rank {o.rank}: {text}", tags, "kind:raised", "at:sync", error_tag(text)))
    if out:
        return out
    if not obs[0].values_meaningful:
        return VALUES_UNCHECKED
    for o in obs:
        checks = [c for c in o.sync_values if pred.non_persistent_synced or c.kind != "non-persistent-buffer"]
        out += _values("INIT-SYNC", checks, tags, "kind:not-synced", f"on rank {o.rank} is not rank 0's")
    return out


@catalog.invariant(
    "INIT-DIVERGENT",
    group="init",
    api="fsdp1|fsdp2",
    scenario="init_order",
    all_ranks=True,
    statement="A module rank 1's forward passes over while the other ranks call it gives the single-process gradients of the same per-rank forwards (read as the losses and final parameters of a few optimizer steps), or a clear error on every rank; never a hang (a collective one rank never enters, on a group of the example's own: every rank blocked there, or its timeout) nor a dead rank.",
    source=DOC_DIVERGENT,
)
def check_divergent(spec: CaseSpec, pred: InitPrediction, obs: list[InitObservation]) -> list[Violation] | NotChecked:
    if pred.plan.skip is None:
        return NotChecked("every rank calls every module")
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    tags = _tags(pred, obs)
    hung = [o.rank for o in obs if o.timed_out]
    if hung:
        return [violation("INIT-DIVERGENT", f"ranks {hung} hung in a collective another rank never entered: "
                          f"{next(o.step_error for o in obs if o.timed_out)}", tags, "kind:hang")]
    errors = [o for o in obs if o.wrap_error or o.step_error]
    if errors and len(errors) < len(obs):
        o = errors[0]
        return [violation("INIT-DIVERGENT", f"only ranks {[e.rank for e in errors]} raised ({o.wrap_error or o.step_error}); the others went on",
                          tags, "kind:one-rank-error", error_tag(o.wrap_error or o.step_error))]
    if errors:
        return NotChecked(f"every rank raised a clear error: {errors[0].wrap_error or errors[0].step_error}")
    return _trajectory("INIT-DIVERGENT", pred, obs, tags)


def ranks_tags(spec: CaseSpec, pred: InitPrediction, obs: list[InitObservation]) -> set[str]:
    """A rank disagreement's facts: which module rank 1 skips, and how its
    group is used (a finding of rank-divergent collectives explains the
    ranks' different values only there)."""
    return {t for t in pred.tags if t.startswith("skip:")}


def failure_tags(spec: CaseSpec, pred: InitPrediction, world_size: int) -> set[str]:
    """A HANG or CRASH of an init_order example: the case's tags (a rank
    that torch's gloo kills on a collective mismatch is then KNOWN)."""
    return set(pred.tags)


INVARIANTS = tuple(catalog.invariants)
