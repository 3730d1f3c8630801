"""What activation checkpointing promises under FSDP (AC-PARITY,
AC-STATE-DICT, AC-ALLGATHER), from the docstrings alone:

- torch.utils.checkpoint.checkpoint: "tensors produced in the passed
  function are not kept alive until the backward pass ... the unsaved
  tensors are recomputed by re-invoking function in the backward pass as
  needed for gradient computation" (a memory-for-compute trade; its only
  warned-of difference is a recompute that differs from the forward, which
  the suite's deterministic forward never is): training with AC is
  training without it.
- create_selective_checkpoint_contexts: the policy only decides which ops'
  outputs are saved rather than recomputed; values do not change.
- checkpoint_wrapper: its state_dict post-hook strips the
  ``_checkpoint_wrapped_module.`` prefix (and its pre-load hook adds it back),
  so a checkpointed model saves the keys of the model without the wrapper;
  FSDP1's and FSDP2's state_dict strip FSDP's own prefixes.
- FSDP's unit structure (the comm oracle, conformance.areas.common.
  comm_oracle): each FSDP2 group / FSDP1 unit is all-gathered in forward and,
  resharded after forward, once more for its backward. Recomputing a region
  in backward reads parameters FSDP already gathers for that backward (a
  region inside a unit runs while its unit is unsharded; a region around a
  unit runs that unit's forward just before the unit's own backward): AC
  adds no all-gather to what the unit structure implies. A unit in a
  checkpointed region whose parameters are all frozen may have no backward
  of its own (nothing to differentiate through it): the recompute, which
  re-invokes its forward, is then the only reader of its parameters in
  backward, and may gather it once for each time the forward gathered it.

The oracle never runs torch.distributed or FSDP."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from conformance.areas.common.comm_oracle import Expected, FSDP2Comm, Knobs, simulate_fsdp1, simulate_fsdp2
from conformance.areas.common.fsdp1_oracle import SIZE_EXCLUDE_WRAP
from conformance.areas.common.fsdp2_oracle import container_given_to_fully_shard, fsdp2_case_tags
from conformance.areas.common.training_oracle import TrainingPrediction, predict_training
from conformance.case.spec import ActivationCheckpointPlan, CaseSpec, CommPlan, CustomWrap, SizeBasedWrap
from conformance.case.target import graph_of

WRAPPERS = ("wrapper-non-reentrant", "wrapper-reentrant")  # the kinds that put a CheckpointWrapper in the tree
# the adapter's guard: a module's forward read a parameter FSDP already freed (adapter.guard_freed_reads)
FREED_READ = "read in forward with its storage freed"
RESHARDED_READ = "read in forward as FSDP's sharded view"


@dataclass(frozen=True)
class ACPrediction:
    spec: CaseSpec
    training: TrainingPrediction
    plan: ActivationCheckpointPlan
    applicable: str  # "" or why training is outside what FSDP promises
    tags: frozenset[str]
    # units (FSDP2 group's first module / FSDP1 unit path) inside a
    # checkpointed region with every parameter frozen: the recompute may be
    # the only reader of their parameters in backward
    frozen_in_region: frozenset[str] = frozenset()
    # the names under which users outside a checkpoint_wrapper's size-policy
    # unit read a tied parameter that unit holds (outside:tie-below-lca)
    tie_reads_outside: frozenset[str] = frozenset()

    def expect(self, world: int) -> Expected:
        """The collectives of the plan's steps without AC (what the unit
        structure implies), each step's input requiring grad as the
        adapter's does."""
        return _expect(self.spec, world)


def below(a: str, b: str) -> bool:
    """b is a proper descendant of a."""
    return a != b and (a == "" or b.startswith(a + "."))


@functools.lru_cache(maxsize=512)
def _expect(spec: CaseSpec, world: int) -> Expected:
    steps = (spec.activation_checkpoint or ActivationCheckpointPlan()).steps
    if spec.plan.api == "fsdp2":
        if any(len(g.modules) > 1 for g in spec.plan.groups):
            # the comm oracle follows a group's hooks on its first module only
            return Expected(why="a multi-module FSDP2 group: the comm oracle follows a group's hooks on its first module only")
        return simulate_fsdp2(spec, world, FSDP2Comm((Knobs(),) * steps), input_grad=True)
    policy = spec.plan.policy
    if isinstance(policy, CustomWrap) and any(k == "sharding_strategy" and v != "FULL_SHARD" for _, kw in policy.kwargs for k, v in kw):
        # the comm oracle models one sharding strategy for every unit
        return Expected(why="a unit with its own sharding strategy (CustomPolicy kwargs): the comm oracle models one strategy for all units")
    if wrappers_that_may_be_units(spec):
        # size_based_auto_wrap_policy never wraps a ModuleList / ModuleDict,
        # but may wrap the CheckpointWrapper around one: units the tree
        # without the wrapper does not have
        return Expected(why="checkpoint_wrapper around a ModuleList / ModuleDict under the size-based policy (the wrapper may become a unit the module could not)")
    # FSDP1's defaults: FULL_SHARD, BACKWARD_PRE, no forward prefetch, limit_all_gathers
    return simulate_fsdp1(spec, world, CommPlan(iterations=steps), input_grad=True)


def wrappers_that_may_be_units(spec: CaseSpec) -> frozenset[str]:
    """The targets whose checkpoint_wrapper FSDP1's size-based policy may
    make a unit where the module itself could not be one (it never wraps a
    ModuleList / ModuleDict, subclasses included): with AC, the case's units
    are not those of the same run without AC."""
    plan = spec.activation_checkpoint or ActivationCheckpointPlan()
    if spec.plan.api != "fsdp1" or not isinstance(spec.plan.policy, SizeBasedWrap) or plan.kind not in WRAPPERS:
        return frozenset()
    g = graph_of(spec)
    return frozenset(t for t in plan.targets if g.is_torch(g.resolve_module(t), SIZE_EXCLUDE_WRAP))


def _tie_reads_below_wrapper_unit(spec: CaseSpec, plan: ActivationCheckpointPlan) -> frozenset[str]:
    """The names under which users outside a checkpoint_wrapper around a
    torch container (which the size policy may make a unit in its stead)
    read a tied parameter inside it."""
    g = graph_of(spec)
    out = set()
    for t in plan.targets:
        if not g.is_torch(g.resolve_module(t), SIZE_EXCLUDE_WRAP):
            continue
        inside = set(g.subtree_params(g.resolve_module(t)))
        for _, pid in g.named_parameters():
            names = g.aliases(pid)
            if pid in inside and len(names) > 1:
                out |= {n for n in names if not n.startswith(t + ".")}
    return frozenset(out)


@functools.lru_cache(maxsize=256)
def predict_ac(spec: CaseSpec) -> ACPrediction:
    training = predict_training(spec)
    plan = spec.activation_checkpoint or ActivationCheckpointPlan()
    g = graph_of(spec)
    tags = {f"api:{spec.plan.api}", f"ac:{plan.kind}"}
    groups: list[tuple[str, ...]] = []
    all_frozen: set[tuple[str, ...]] = set()  # the units that manage parameters, none trainable
    if spec.plan.api == "fsdp1":
        tags.add(f"uop:{str(spec.plan.use_orig_params).lower()}")
        if training.fsdp1 is not None and training.fsdp1.error is None:
            groups = [(u.path,) for u in training.fsdp1.units if u.path]
            all_frozen = {(u.path,) for u in training.fsdp1.units if u.path and u.managed and not u.trainable}
    elif training.fsdp2 is not None:
        groups = [grp.modules for grp in training.fsdp2.groups if not grp.root]
        all_frozen = {grp.modules for grp in training.fsdp2.groups if not grp.root and grp.managed and not grp.trainable}
    wrapper = plan.kind in WRAPPERS
    frozen_in_region = set()
    for t in plan.targets:
        for mods in groups:
            if len(mods) > 1 and any(t == m or below(t, m) or below(m, t) for m in mods):
                tags.add("ac:multi-module-group")  # it is, holds or sits in a module of a fully_shard([a, b]) group
            if t in mods:
                tags.add("ac:is-unit")  # the checkpointed module is an FSDP unit / given to fully_shard itself
            inside = [m for m in mods if below(t, m)]
            if inside:
                # it holds (a module of) a unit: recompute runs that unit's forward
                tags.add("ac:around-unit" if len(inside) == len(mods) else "ac:across-unit")
            if any(below(m, t) for m in mods):
                tags.add("ac:inside-unit")  # inside a non-root unit
            # a wrapper stays outside the module it checkpoints, so that
            # unit's hooks run inside the region; a patched forward does not
            if mods in all_frozen and any(below(t, m) or (wrapper and t == m) for m in mods):
                frozen_in_region.add(mods[0])
    if "ac:around-unit" in tags or "ac:across-unit" in tags or ("ac:is-unit" in tags and wrapper):
        # a unit's forward runs inside a checkpointed region (a wrapper stays
        # outside the module FSDP wraps or shards): recompute runs its hooks
        tags.add("ac:unit-in-region")
    if frozen_in_region:
        tags.add("ac:frozen-unit-in-region")
    tie_reads = frozenset()
    if wrapper and spec.plan.api == "fsdp1" and isinstance(spec.plan.policy, SizeBasedWrap):
        tie_reads = _tie_reads_below_wrapper_unit(spec, plan)
    if tie_reads:
        # size_based_auto_wrap_policy never wraps a ModuleList / ModuleDict but
        # may wrap the CheckpointWrapper around one: a unit the tree without
        # AC does not have, below a tie's users' common ancestor (TIES: FSDP1
        # must reject such a unit; where it does not, training's consequence
        # is fsdp1-tie-below-lca-not-rejected's)
        tags.add("outside:tie-below-lca")
    if not any(tag in tags for tag in ("ac:is-unit", "ac:around-unit", "ac:across-unit", "ac:inside-unit")):
        tags.add("ac:root-unit")  # only the root unit manages it
    if spec.plan.api == "fsdp2" and container_given_to_fully_shard(spec):
        tags.add("container-subclass")  # a ModuleList/ModuleDict subclass with a forward, given to fully_shard
    if training.fsdp2 is not None:
        # a list group whose last module's output needs no gradient, which
        # FSDP2 leaves resharded for the backward of its earlier modules
        # (fsdp2-frozen-list-group-freed-in-backward): a recompute of one of
        # them reads its sharded parameters
        tags |= {t for t in fsdp2_case_tags(spec, training.fsdp2) if t.startswith("group:multi-frozen-embedding")}
    if training.frozen:
        tags.add("frozen")
        if any(f == t or f.startswith(t + ".") for f in training.frozen for t in plan.targets):
            tags.add("ac:frozen-inside")
    if any(len(g.aliases(pid)) > 1 for _, pid in g.named_parameters()):
        tags.add("tie")
    return ACPrediction(spec, training, plan, training.applicable, frozenset(tags), frozenset(frozen_in_region), tie_reads)
