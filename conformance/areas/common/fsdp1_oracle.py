"""The FSDP1 oracle: what FullyShardedDataParallel auto-wrapping promises for a
module graph and a wrap plan (units, managed parameters, frozen-parameter
outcome, state dict)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from conformance.case.graph import ModelGraph
from conformance.case.spec import CaseSpec, CustomWrap, LambdaWrap, ModuleWrap, SizeBasedWrap, TransformerWrap, WrapPlan
from conformance.case.target import graph_of

# size_based_auto_wrap_policy's documented defaults (torch.nn classes)
SIZE_EXCLUDE_WRAP = ("ModuleList", "ModuleDict")
# "module types to keep as leaves, i.e. their children will never be
# wrapped" (force_leaf_modules): the policy never recurses into one, so
# neither it nor anything below it becomes a unit; its parameters stay with
# the unit above. Only real models have one (synthetic trees do not draw it).
SIZE_FORCE_LEAF = ("MultiheadAttention",)


@dataclass(frozen=True)
class UnitPrediction:
    path: str  # canonical path of the unit's module ("" for the root)
    managed: tuple[str, ...]  # canonical FQNs
    trainable: tuple[str, ...]
    frozen: tuple[str, ...]
    trainable_numel: int
    frozen_numel: int

    @property
    def total_numel(self) -> int:
        return self.trainable_numel + self.frozen_numel

    @property
    def mixed(self) -> bool:
        return bool(self.trainable) and bool(self.frozen)


@dataclass(frozen=True)
class TiePrediction:
    fqn: str  # canonical FQN of the tied parameter
    aliases: tuple[str, ...]
    unit: str | None  # the unit managing it (None: ignored)
    lca: str  # lowest common ancestor of its users (canonical path)
    below_lca: bool  # unit is a strict descendant of the LCA: FSDP must reject


@dataclass(frozen=True)
class FSDP1Prediction:
    units: tuple[UnitPrediction, ...]  # in registration post-order
    # use_orig_params=False: the first mixed unit raises; True: each warns
    error: UnitPrediction | None
    warnings: tuple[UnitPrediction, ...]
    ignored: tuple[str, ...]  # canonical FQNs of ignored parameters
    state_dict_keys: tuple[str, ...]
    named_parameters: tuple[str, ...]
    ties: tuple[TiePrediction, ...]
    shared_modules: bool  # some module has two names
    policy_kind: str  # "none" | "ModuleWrap" | ... (for tags)

    def unit(self, path: str) -> UnitPrediction:
        return next(u for u in self.units if u.path == path)


def grad_carrying(units, trainable, use_orig_params: bool) -> set[str]:
    """The managed parameters (canonical FQNs) of ``units`` whose forward
    value requires grad under FSDP1: the ``trainable`` ones and, with
    use_orig_params=True, every parameter of a unit that has a trainable one
    (a frozen parameter's forward value is then a view of the unit's flat
    parameter, which requires grad: FlatParamHandle._use_unsharded_views).
    A read of one gives the unit a gradient and makes its output need one."""
    trainable = set(trainable)
    out = set()
    for u in units:
        mine = set(u.managed) & trainable
        out |= set(u.managed) if mine and use_orig_params else mine
    return out


def ignored_sets(g: ModelGraph, plan: WrapPlan) -> tuple[set[str], set[str]]:
    """(ignored node ids, ignored param ids): ignored modules with everything
    below them, their parameters, and the ignored parameters themselves."""
    nodes: set[str] = set()
    for path in plan.ignored_modules:
        nodes.update(g.subtree(g.resolve_module(path)))
    params = {pid for n in nodes for _, pid in g.nodes[n].params}
    params.update(g.resolve_param(f) for f in plan.ignored_params)
    return nodes, params


def wrap_targets(g: ModelGraph, plan: WrapPlan, ignored_nodes: set[str], ignored_params: set[str]) -> set[str]:
    """Node ids the policy wraps (the root, always a unit, not included)."""
    pol = plan.policy
    candidates = [nid for nid in g.post_order() if nid not in ignored_nodes and nid != ""]
    if pol is None:
        return set()
    if isinstance(pol, (ModuleWrap, TransformerWrap)):
        return {n for n in candidates if g.isinstance_of(n, pol.classes)}
    if isinstance(pol, (CustomWrap, LambdaWrap)):
        targets = {g.resolve_module(p) for p in pol.targets}
        return {n for n in candidates if n in targets}
    if isinstance(pol, SizeBasedWrap):
        # Post-order: wrap a module when the numel of its subtree not yet
        # wrapped (and not ignored) reaches min_num_params; never the
        # excluded container types.
        wrapped: set[str] = set()
        claimed: set[str] = set(ignored_params)
        leaves = {m for n in candidates if g.is_torch(n, SIZE_FORCE_LEAF) for m in g.subtree(n)}
        for n in candidates:
            if n in leaves:
                continue
            remainder = [p for p in g.subtree_params(n) if p not in claimed]
            if sum(g.numel(p) for p in remainder) >= pol.min_num_params and not g.is_torch(n, SIZE_EXCLUDE_WRAP):
                wrapped.add(n)
                claimed.update(remainder)
        return wrapped
    raise TypeError(f"unknown policy {pol!r}")


def _lca(g: ModelGraph, nids: list[str]) -> str:
    """Deepest node whose subtree holds every node in ``nids``."""
    best = ""
    for nid in g.post_order():  # children before parents: first hit is deepest
        sub = set(g.subtree(nid))
        if all(n in sub for n in nids):
            return nid
    return best


@functools.lru_cache(maxsize=256)
def predict_fsdp1(spec) -> FSDP1Prediction:
    """For a CaseSpec or a ModelCase: its graph and its plan. Cached: every
    invariant of an example asks for the same prediction."""

    return fsdp1_prediction(graph_of(spec), spec.plan)


def fsdp1_prediction(g: ModelGraph, plan: WrapPlan) -> FSDP1Prediction:
    """What FSDP1 promises for the model graph ``g`` wrapped as ``plan`` says."""
    ignored_nodes, ignored_params = ignored_sets(g, plan)
    targets = wrap_targets(g, plan, ignored_nodes, ignored_params)
    claimed = set(ignored_params)
    units: list[UnitPrediction] = []
    owner: dict[str, str] = {}
    for nid in g.post_order():
        if nid != "" and nid not in targets:
            continue
        mine = [p for p in g.subtree_params(nid) if p not in claimed]
        claimed.update(mine)
        for p in mine:
            owner[p] = nid
        train = [p for p in mine if g.requires_grad(p)]
        frozen = [p for p in mine if not g.requires_grad(p)]
        units.append(
            UnitPrediction(
                path=g.module_path[nid],
                managed=tuple(g.param_fqn[p] for p in mine),
                trainable=tuple(g.param_fqn[p] for p in train),
                frozen=tuple(g.param_fqn[p] for p in frozen),
                trainable_numel=sum(g.numel(p) for p in train),
                frozen_numel=sum(g.numel(p) for p in frozen),
            )
        )
    mixed = tuple(u for u in units if u.mixed)
    uop = plan.use_orig_params
    ties = []
    for _, pid in g.named_parameters():
        users = g.users(pid)
        aliases = g.aliases(pid)
        if len(aliases) < 2 or len(set(users)) < 2:
            continue  # a shared module repeats names but is one user: not a tie
        lca = _lca(g, users)
        unit = owner.get(pid)
        below = unit is not None and unit != lca and unit in g.subtree(lca)
        ties.append(
            TiePrediction(
                fqn=g.param_fqn[pid],
                aliases=tuple(aliases),
                unit=None if unit is None else g.module_path[unit],
                lca=g.module_path[lca],
                below_lca=below,
            )
        )
    pol = plan.policy
    return FSDP1Prediction(
        units=tuple(units),
        error=None if uop or not mixed else mixed[0],
        warnings=mixed if uop else (),
        ignored=tuple(sorted(g.param_fqn.get(p, p) for p in ignored_params)),
        state_dict_keys=tuple(g.state_dict_keys()),
        named_parameters=tuple(f for f, _ in g.named_parameters()),
        ties=tuple(ties),
        shared_modules=g.shared_modules(),
        policy_kind="none" if pol is None else type(pol).__name__,
    )


CALLABLE_POLICIES = {"SizeBasedWrap", "LambdaWrap", "TransformerWrap"}


def fsdp1_case_tags(spec: CaseSpec, pred: FSDP1Prediction) -> set[str]:
    """Facts about a case that known_failures.toml entries match on."""
    tags = {f"policy:{pred.policy_kind}", f"uop:{str(spec.plan.use_orig_params).lower()}"}
    tags.add("policy:callable" if pred.policy_kind in CALLABLE_POLICIES else "policy:object")
    if pred.shared_modules:
        tags.add("shared-module")
    for t in pred.ties:
        tags.add("tie")
        if t.below_lca:
            tags.add("tie:below-lca")
    if any(t.below_lca or _alias_outside_unit(t, pred) for t in pred.ties):
        tags.add("tie:cross-unit")
    if spec.plan.ignored_modules or spec.plan.ignored_params:
        tags.add("ignored")
    return tags


def _alias_outside_unit(t, pred: FSDP1Prediction) -> bool:
    """Some alias of the tied parameter lives under another unit's module."""
    if t.unit is None:
        return False
    unit_paths = sorted((u.path for u in pred.units if u.path), key=len, reverse=True)

    def unit_of(fqn: str) -> str:
        return next((p for p in unit_paths if fqn.startswith(p + ".")), "")

    return len({unit_of(a) for a in t.aliases}) > 1
