"""What FSDP promises of an init_order case, from the docstrings and
upstream tests alone: training is promised wherever training_oracle says,
whatever the order of the user's actions around lazy initialisation
(fully_shard: "the module's parameters are DTensors" from sharding on, lazy
init at the first forward; FSDPModule.unshard: "unshard the module's
parameters", async_op returns a handle to wait on); meta-device init ends
with the non-meta values the user's init writes; FSDP1 sync_module_states
broadcasts "module parameters and buffers" (all of them: the docstring
names no exception, _sync_module_params_and_buffers reads module.buffers());
FSDP2's set_model_state_dict(broadcast_from_rank0=True) loads the state
dict (persistent buffers, not the non-persistent ones a state dict does not
hold); a parameter registered anew between fully_shard and lazy init is the
one FSDP2 trains (FSDPParamGroup.lazy_init: "Users may change or register
parameters after construction time. For example, DoRA ...")."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from conformance.areas.common.fsdp1_oracle import grad_carrying
from conformance.areas.common.fsdp2_oracle import container_given_to_fully_shard, list_group_tags
from conformance.areas.common.training_oracle import TrainingPrediction, predict_training
from conformance.areas.common.violations import tie_within_one_module
from conformance.case.spec import CaseSpec, InitPlan
from conformance.case.target import graph_of


@dataclass(frozen=True)
class InitPrediction:
    training: TrainingPrediction
    plan: InitPlan
    applicable: str  # "" or why training is outside what the API promises
    # the non-persistent buffers a sync must make rank 0's: FSDP1's
    # sync_module_states (all buffers), not FSDP2's state-dict broadcast
    non_persistent_synced: bool
    # the skipped module's trainable parameters (a rank-divergent case
    # diverges only where there are some)
    skip_trains: bool
    tags: frozenset[str]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")


@functools.lru_cache(maxsize=256)
def predict_init(spec: CaseSpec) -> InitPrediction:
    training = predict_training(spec)
    plan = spec.init or InitPlan()
    g = graph_of(spec)
    api = spec.plan.api
    tags = {f"api:{api}", f"optim:{plan.optimizer}", "optim:after-forward" if plan.optimizer_after_forward else "optim:before-forward"}
    if api == "fsdp1":
        tags.add(f"uop:{str(spec.plan.use_orig_params).lower()}")
    tags |= {f"action:{a}" for a in plan.before}
    if plan.dtype:
        tags.add(f"dtype:{plan.dtype}")
    if plan.meta:
        tags.add("init:meta")
    if plan.sync:
        tags.add("init:sync")
    if plan.replace:
        tags.add("init:replace")
    if training.frozen:
        tags.add("frozen")
    if spec.shared:
        tags.add("shared-module")
    if api == "fsdp2" and container_given_to_fully_shard(spec):
        tags.add("container-subclass")  # a ModuleList/ModuleDict subclass with a forward, given to fully_shard
    if tie_within_one_module(spec):
        tags.add("tie:same-module")  # one module holds a Parameter under two of its names
    if any(len(g.aliases(pid)) > 1 for _, pid in g.named_parameters()):
        tags.add("tie")
    if training.fsdp2 is not None:
        tags |= list_group_tags(spec, training.fsdp2)
    if plan.dtype and any(a.startswith("unshard") for a in plan.before):
        tags.add("dtype:after-lazy-init")  # unshard() ran FSDP's lazy init before to(dtype)
    skip_trains = False
    if plan.skip is not None:
        below = {f for f, pid in g.named_parameters() if _under(f.rpartition(".")[0], plan.skip) and g.requires_grad(pid)}
        skip_trains = bool(below)
        tags.add("skip:trainable" if below else "skip:no-trainable")
        tags |= _skip_tags(training, below, plan.skip)
        if _frozen_unit_backward_on_rank0_only(training, g, plan.skip, spec.plan.use_orig_params):
            tags.add("skip:frozen-unit-backward-one-rank")
    return InitPrediction(training, plan, training.applicable, api == "fsdp1", skip_trains, frozenset(tags))


def _skip_tags(training: TrainingPrediction, below: set[str], skip: str) -> set[str]:
    """How rank 1's skipped module sits in FSDP's groups (FSDP1 units):
    skip:own-group, a group managing parameters whose module rank 1 never
    calls (its all-gather is never issued there, frozen parameters
    included); skip:group-unused, a group whose forward runs on rank 1 but
    none of whose trainable parameters gets a gradient there (``below``: the
    skipped trainable ones); skip:group-partly-used, a group some of whose
    gradients rank 1 lacks."""
    if training.fsdp2 is not None:
        groups = [(grp.modules, set(grp.managed), set(grp.trainable)) for grp in training.fsdp2.groups]
    elif training.fsdp1 is not None:
        trainable = set(training.trainable)
        groups = [((u.path,), set(u.managed), set(u.managed) & trainable) for u in training.fsdp1.units]
    else:
        return set()
    tags = set()
    for modules, managed, trainable in groups:
        if managed and any(m and _under(m, skip) for m in modules):
            tags.add("skip:own-group")
            continue
        unused = trainable & below
        if not unused:
            continue
        tags.add("skip:group-unused" if unused == trainable else "skip:group-partly-used")
    return tags


def _frozen_unit_backward_on_rank0_only(training: TrainingPrediction, g, skip: str, use_orig_params: bool) -> bool:
    """FSDP1: a non-root unit every parameter of which is frozen, whose module
    rank 1 calls, and whose output needs a gradient on rank 0 but not on
    rank 1 (the skipped module was all that made its input need one). FSDP1
    hooks a unit's pre-backward (the all-gather of a resharded unit) on the
    forward outputs that require grad, so only rank 0 runs that unit's
    backward. A parameter's forward value needs a gradient where it is
    trainable or, managed, where grad_carrying says so (a frozen one in a
    unit with a trainable one, under use_orig_params=True)."""
    if training.fsdp1 is None:
        return False
    trainable = set(training.trainable)
    carrying = grad_carrying(training.fsdp1.units, trainable, use_orig_params) | trainable

    def needs_grad(reads: set[str]) -> bool:
        return bool(carrying & set(reads))

    for u in training.fsdp1.units:
        nid = g.resolve_module(u.path)
        if not u.path or not u.managed or set(u.managed) & trainable or _under(nid, skip):
            continue
        if needs_grad(g.reads_through((), nid)) and not needs_grad(g.reads_through((skip,), nid)):
            return True
    return False
