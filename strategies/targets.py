"""Strategies over a real model (a Target): the parts users vary, drawn over
the model's own graph: freeze masks, wrap model_policies from the model's classes
and real numels, use_orig_params, FSDP2 groupings with
reshard_after_forward, which of its methods to register, a training plan.

Every choice shrinks towards the simplest: nothing frozen, no policy, one
class, one module, the fewest names.
"""

from __future__ import annotations

from typing import Iterable

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.areas.common.fsdp2_oracle import TORCH_CONTAINERS
from conformance.case.model_case import ModelCase
from conformance.case.spec import (
    CUSTOM_KWARGS,
    CustomWrap,
    ForwardMethod,
    LambdaWrap,
    ModuleWrap,
    ShardGroup,
    SizeBasedWrap,
    TrainPlan,
    TransformerWrap,
    WrapPlan,
)
from conformance.case.target import TargetError, base_graph, cached_target
from strategies._common import check_kinds, check_strategy
from strategies.policies import APIS, POLICY_KINDS

# "random" right after "none": a failure shrinks to one frozen parameter
MODEL_FREEZE_KINDS = ("none", "random", "patterns", "bitfit", "factory")
# Classes no wrap policy should name: nn.Module matches everything, and
# torch's containers have no forward of their own.
_NOT_UNITS = ("Module", *TORCH_CONTAINERS)


class _Model:
    """What the strategies need to know about a target's model, computed once."""

    def __init__(self, ref: str) -> None:
        try:
            self.target = cached_target(ref)
            g = self.graph = base_graph(ref)
        except TargetError as e:
            raise InvalidArgument(str(e)) from None
        self.ref = ref
        self.params = [fqn for fqn, _ in g.named_parameters()]  # canonical
        self.aliases = {g.param_fqn[pid]: g.aliases(pid) for pid in g.param_info}
        self.factory_frozen = tuple(f for f, pid in g.named_parameters() if not g.requires_grad(pid))
        self.modules = [p for p, nid in g.named_modules() if p]  # canonical, root excluded
        with_params = {p for p in self.modules if g.subtree_params(g.resolve_module(p))}
        self.unit_modules = [p for p in self.modules if p in with_params and not g.is_torch(g.resolve_module(p), TORCH_CONTAINERS, exact=True)]
        # classes by id (module.QualName): two classes may share a __name__
        not_units = {g.torch_class_id(c) for c in _NOT_UNITS} | {g.nodes[""].ids[0]}
        seen = [c for c in g.class_ids() if c not in not_units]
        self.wrap_classes = []
        for c in self.target.wrap_classes:
            try:
                self.wrap_classes.append(g.resolve_class(c))
            except KeyError as e:  # check_target says the same
                raise InvalidArgument(f"target {ref!r}: wrap class {c!r} {e}") from None
        own = [c for c in self.wrap_classes if c in seen]
        # the target's wrap candidates first (the simplest draw), then the rest
        self.classes = own + [c for c in seen if c not in own]
        numels = sorted({sum(g.numel(p) for p in g.subtree_params(g.resolve_module(m))) for m in self.modules} - {0})
        self.numels = numels or [1]

    def frozen_for_trainable(self, keep) -> tuple[str, ...]:
        """The freeze mask that trains exactly the parameters ``keep(alias)`` holds for (any alias)."""
        return tuple(f for f in self.params if not any(keep(a) for a in self.aliases[f]))


_MODELS: dict[str, _Model] = {}


def _model(ref: str) -> _Model:
    if ref not in _MODELS:
        _MODELS[ref] = _Model(ref)
    return _MODELS[ref]


def model_freeze_masks(target: str, kinds: Iterable[str] = MODEL_FREEZE_KINDS) -> SearchStrategy[tuple[str, ...]]:
    """FQNs to freeze (canonical): nothing; a random subset (shrinks to one
    parameter); or a preset, toggled at up to three parameters: "train only
    what matches" one of the target's trainable_patterns (LoRA-like), BitFit
    (only biases train), or as the factory made it (PEFT's own freezing).

    A failure shrinks to the random branch (the fewest frozen parameters)
    whenever one frozen parameter is enough."""
    kinds = check_kinds(kinds, "kinds", MODEL_FREEZE_KINDS)
    m = _model(target)
    presets: list[tuple[str, ...]] = []
    if "patterns" in kinds:
        for pats in m.target.trainable_patterns:
            presets.append(m.frozen_for_trainable(lambda a, pats=pats: any(p in a for p in pats)))
    if "bitfit" in kinds:
        presets.append(m.frozen_for_trainable(lambda a: a.rsplit(".", 1)[-1] == "bias"))
    if "factory" in kinds and m.factory_frozen:
        presets.append(m.factory_frozen)
    options: list[SearchStrategy] = []
    if "none" in kinds:
        options.append(st.just(()))
    if "random" in kinds:
        options.append(st.lists(st.sampled_from(m.params), min_size=1, unique=True).map(
            lambda fs: tuple(f for f in m.params if f in fs)))
    if presets:
        toggles = st.lists(st.sampled_from(m.params), max_size=3, unique=True)

        def preset(i: int, _cost: tuple, flip: list[str]) -> tuple[str, ...]:
            mask = set(presets[i % len(presets)]) ^ set(flip)
            return tuple(f for f in m.params if f in mask)

        # Hypothesis shrinks shortlex over its choices: ``_cost`` makes a
        # preset dearer than one random parameter, so that a failure one
        # frozen parameter shows shrinks to that parameter.
        cost = st.tuples(st.integers(0, 1), st.integers(0, 1), st.integers(0, 1))
        options.append(st.builds(preset, st.integers(0, max(1, len(presets) - 1)), cost, toggles))
    if not options:
        raise InvalidArgument(f"target {target!r}: none of the freeze kinds {kinds} applies")
    return st.one_of(options)


def _subset(items: list[str], max_size: int = 3) -> SearchStrategy[tuple[str, ...]]:
    """1..max_size distinct items, in the items' order, shrinking to the first."""
    return st.lists(st.sampled_from(items), min_size=1, max_size=max_size, unique=True).map(
        lambda xs: tuple(x for x in items if x in xs))


@st.composite
def _custom(draw, m: _Model) -> CustomWrap:
    targets = draw(_subset(m.unit_modules), label="CustomPolicy targets")
    kwargs = []
    for t in targets:
        if draw(st.booleans(), label=f"kwargs for {t}"):
            key = draw(st.sampled_from(sorted(CUSTOM_KWARGS)))
            kwargs.append((t, ((key, draw(st.sampled_from(CUSTOM_KWARGS[key]))),)))
    return CustomWrap(targets, tuple(kwargs))


def model_policies(target: str, kinds: Iterable = POLICY_KINDS) -> SearchStrategy:
    """A wrap policy over the model's own classes, module paths and numels."""
    kinds = check_kinds(kinds, "kinds", POLICY_KINDS)
    m = _model(target)
    out: list[SearchStrategy] = []
    for k in kinds:
        if k is None:
            out.append(st.none())
        elif k is ModuleWrap and m.classes:
            out.append(_subset(m.classes).map(ModuleWrap))
        elif k is TransformerWrap and m.classes:
            out.append(_subset(m.classes).map(TransformerWrap))
        elif k is CustomWrap and m.unit_modules:
            out.append(_custom(m))
        elif k is LambdaWrap and m.unit_modules:
            out.append(_subset(m.unit_modules).map(LambdaWrap))
        elif k is SizeBasedWrap:
            # thresholds at the model's real subtree sizes (and just above):
            # where the policy's decisions change
            out.append(st.builds(lambda n, up: SizeBasedWrap(n + up), st.sampled_from(m.numels), st.sampled_from((0, 1))))
    return st.one_of(out)


@st.composite
def shard_groups(draw, target: str) -> tuple[ShardGroup, ...]:
    """FSDP2 fully_shard calls besides the root's: modules of the target's
    wrap classes (else any module with parameters), each with
    reshard_after_forward None / True / False; sometimes the root's own."""
    m = _model(target)
    g = m.graph
    preferred = [p for p in m.unit_modules if g.isinstance_of(g.resolve_module(p), tuple(m.wrap_classes))]
    pool = preferred or m.unit_modules
    rafs = st.sampled_from((None, True, False))
    groups = []
    if pool and draw(st.booleans(), label="shard submodules"):
        for p in draw(_subset(pool, max_size=4), label="fully_shard modules"):
            groups.append(ShardGroup((p,), draw(rafs, label=f"reshard_after_forward {p}")))
    root_raf = draw(rafs, label="root reshard_after_forward")
    if root_raf is not None:
        groups.append(ShardGroup(("",), root_raf))
    return tuple(groups)


def model_cases(
    target: str,
    *,
    apis: SearchStrategy[str] = st.sampled_from(APIS),
    freeze: Iterable[str] = MODEL_FREEZE_KINDS,
    policy_kinds: Iterable = POLICY_KINDS,
    seeds: SearchStrategy[int] = st.integers(0, 3),
) -> SearchStrategy[ModelCase]:
    """ModelCases over ``target`` ("package.module:attr")."""
    if not isinstance(target, str):
        raise InvalidArgument(f"target={target!r} must be a 'package.module:attr' string")
    check_strategy(apis, "apis")
    check_strategy(seeds, "seeds")
    _model(target)  # fails early, naming the target
    return _model_cases(target, apis, tuple(freeze), tuple(policy_kinds), seeds)


@st.composite
def _model_cases(draw, target, apis, freeze, policy_kinds, seeds) -> ModelCase:
    m = _model(target)
    api = draw(apis, label="api")
    frozen = draw(model_freeze_masks(target, freeze), label="freeze mask")
    if api == "fsdp1":
        plan = WrapPlan("fsdp1", draw(model_policies(target, policy_kinds), label="policy"), draw(st.booleans(), label="use_orig_params"))
        methods: tuple[ForwardMethod, ...] = ()
    else:
        plan = WrapPlan("fsdp2", groups=draw(shard_groups(target), label="FSDP2 groups"))
        methods = tuple(
            ForwardMethod("", mc.name, (), draw(st.booleans(), label=f"register {mc.name}")) for mc in m.target.methods
        )
    train = TrainPlan(draw(st.sampled_from(("SGD", "Adam")), label="optimizer"), draw(st.integers(1, 2), label="steps"))
    return ModelCase(target, draw(seeds, label="seed"), frozen, plan, methods, train)
