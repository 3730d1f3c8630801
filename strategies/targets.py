"""Strategies over a real model (a Target): the parts users vary, drawn over
the model's own graph: freeze masks, wrap model_policies from the model's classes
and real numels, use_orig_params, FSDP2 groupings with
reshard_after_forward, which of its methods to register, a training plan,
and the lifecycle: a checkpoint plan (how a full state dict is taken or
loaded, a save and load under another plan, API and world size, freeze
changes) or a training schedule (mixed precision, accumulation, freeze
changes). ``natural_model_cases`` lists the configurations users run (each
wrap class as a policy, each trainable pattern, FSDP2 per wrap class with
every method registered): the runs check them first, whatever the budget.

Every choice shrinks towards the simplest: nothing frozen, no policy, one
class, one module, the fewest names.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.areas.checkpoint.oracle import predict_ckpt
from conformance.areas.common.fsdp2_oracle import TORCH_CONTAINERS
from conformance.areas.common.training_oracle import predict_training
from conformance.areas.schedule.oracle import predict_schedule
from conformance.case.model_case import ModelCase
from conformance.case.spec import (
    CKPT_OPTIMIZERS,
    CKPT_PRECISIONS,
    CUSTOM_KWARGS,
    FSDP1_STRATEGIES,
    LOAD_PATHS,
    SCHEDULE_OPTIMIZERS,
    CheckpointPlan,
    CustomWrap,
    ForwardMethod,
    LambdaWrap,
    Microbatch,
    ModuleWrap,
    Precision,
    Schedule,
    ScheduleStep,
    ShardGroup,
    SizeBasedWrap,
    TrainPlan,
    TransformerWrap,
    WrapPlan,
)
from conformance.case.target import TargetError, base_graph, cached_target
from conformance.strategies._common import check_kinds, check_strategy, ints, maybe, pick, pick_subset
from conformance.strategies.checkpoint import per_parameter
from conformance.strategies.policies import APIS, POLICY_KINDS
from conformance.strategies.schedule import draw_precision

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


# What a case is drawn for: None (wrapping, forward methods, PARITY), or one
# lifecycle scenario: "full" (SD-FULL), "ties" (TIES-KEPT), "roundtrip"
# (CKPT-RESHARD, OPTIM-STATE), "schedule" (MP-DTYPES, ACCUM).
LIFECYCLES = (None, "full", "ties", "roundtrip", "schedule")
# The base pool's world size first (cheapest), then the driver (1), then 3:
# 3 divides none of the zoo's dimensions (uneven shards).
CKPT_WORLDS = (2, 1, 3)


def model_cases(
    target: str,
    *,
    apis: SearchStrategy[str] = st.sampled_from(APIS),
    freeze: Iterable[str] = MODEL_FREEZE_KINDS,
    policy_kinds: Iterable = POLICY_KINDS,
    seeds: SearchStrategy[int] = st.integers(0, 3),
    lifecycle: str | None = None,
) -> SearchStrategy[ModelCase]:
    """ModelCases over ``target`` ("package.module:attr"); with a
    ``lifecycle`` (one of LIFECYCLES), each with that checkpoint plan or
    training schedule, drawn over the model (its parameters, classes,
    trainable patterns), among the cases whose training FSDP promises."""
    if not isinstance(target, str):
        raise InvalidArgument(f"target={target!r} must be a 'package.module:attr' string")
    if lifecycle not in LIFECYCLES:
        raise InvalidArgument(f"lifecycle={lifecycle!r} must be one of {LIFECYCLES}")
    check_strategy(apis, "apis")
    check_strategy(seeds, "seeds")
    _model(target)  # fails early, naming the target
    cases = _model_cases(target, apis, tuple(freeze), tuple(policy_kinds), seeds, lifecycle)
    return cases if lifecycle is None else cases.filter(lifecycle_fits)


def _plan(draw, target: str, api: str, policy_kinds) -> WrapPlan:
    if api == "fsdp1":
        return WrapPlan("fsdp1", draw(model_policies(target, policy_kinds), label="policy"), draw(st.booleans(), label="use_orig_params"))
    return WrapPlan("fsdp2", groups=draw(shard_groups(target), label="FSDP2 groups"))


@st.composite
def _model_cases(draw, target, apis, freeze, policy_kinds, seeds, lifecycle=None) -> ModelCase:
    m = _model(target)
    api = draw(apis, label="api")
    frozen = draw(model_freeze_masks(target, freeze), label="freeze mask")
    plan = _plan(draw, target, api, policy_kinds)
    if api == "fsdp1":
        methods: tuple[ForwardMethod, ...] = ()
    else:
        methods = tuple(
            ForwardMethod("", mc.name, (), draw(st.booleans(), label=f"register {mc.name}")) for mc in m.target.methods
        )
    if lifecycle is not None:
        case = ModelCase(target, draw(seeds, label="seed"), frozen, plan)
        if api == "fsdp1" and not case.plan.use_orig_params and not _trains(case):
            # a mixed unit FSDP1 rejects with flat parameters: the lifecycle
            # of the same plan with use_orig_params=True (mixed units warn)
            case = dataclasses.replace(case, plan=dataclasses.replace(plan, use_orig_params=True))
        if lifecycle == "schedule":
            return _with_schedule(draw, m, case)
        return _with_ckpt(draw, m, case, lifecycle, freeze, policy_kinds)
    train = TrainPlan(draw(st.sampled_from(("SGD", "Adam")), label="optimizer"), draw(st.integers(1, 2), label="steps"))
    return ModelCase(target, draw(seeds, label="seed"), frozen, plan, methods, train)


def _trains(case: ModelCase) -> bool:
    try:
        return not predict_training(case).applicable
    except Exception:  # an oracle that rejects the case: not one to train
        return False


def lifecycle_fits(case: ModelCase) -> bool:
    """FSDP promises the case's training (at the save and at the load; its
    schedule's precision one the model itself runs in)."""
    try:
        if case.ckpt is not None:
            return not predict_ckpt(case).applicable
        if case.schedule is not None and predict_schedule(case).applicable:
            return False
        return not predict_training(case).applicable
    except Exception:
        return False


def _with_ckpt(draw, m: _Model, case: ModelCase, kind: str, freeze, policy_kinds) -> ModelCase:
    """A checkpoint plan: how the full state dict is taken (full), how one is
    loaded (ties), or a save under the case's plan and a load under another
    plan, API, world size and freeze mask (roundtrip)."""
    api = case.plan.api
    save_world = pick(draw, CKPT_WORLDS)
    if kind == "full":
        way = pick(draw, ("dcp-full", "fsdp1-full")) if api == "fsdp1" else "dcp-full"
        # FSDP1's offload_to_cpu on a CPU device breaks ranks (a recorded
        # finding of the generated cases; a hung rank costs the deadline):
        # not drawn on a model
        # a checkpoint of the model in use (a forward first), under bf16
        # mixed precision or not (float16 left out: not every op of a real
        # model has a float16 kernel on CPU)
        precisions = [p for p in CKPT_PRECISIONS if "float16" not in (p.param_dtype, p.buffer_dtype) and (api == "fsdp1" or not p.buffer_dtype)]
        ck = CheckpointPlan(save_world=save_world, full_sd=way, offload=api == "fsdp2" and maybe(draw, 1),
                            rank0_only=way == "fsdp1-full" and maybe(draw, 1), ignore_frozen=way == "dcp-full" and maybe(draw, 1),
                            warm=maybe(draw, 1), precision=pick(draw, precisions) if maybe(draw, 1) else None)
        return dataclasses.replace(case, ckpt=ck)
    if kind == "ties":
        paths = LOAD_PATHS if api == "fsdp2" else tuple(p for p in LOAD_PATHS if p != "set_model_state_dict-broadcast")
        if api == "fsdp1":  # flat parameters have no per-name Parameter to tie
            case = dataclasses.replace(case, plan=dataclasses.replace(case.plan, use_orig_params=True))
        # under bf16 mixed precision or not (as full)
        precisions = [p for p in CKPT_PRECISIONS if "float16" not in (p.param_dtype, p.buffer_dtype) and (api == "fsdp1" or not p.buffer_dtype)]
        return dataclasses.replace(case, ckpt=CheckpointPlan(save_world=save_world, load_path=pick(draw, paths),
                                                             precision=pick(draw, precisions) if maybe(draw, 1) else None))
    load_api = pick(draw, (api, "fsdp2" if api == "fsdp1" else "fsdp1"))
    load_plan = _plan(draw, m.ref, load_api, policy_kinds)
    ck = CheckpointPlan(save_world=save_world, load_world=pick(draw, CKPT_WORLDS), load_plan=load_plan,
                        optimizer=pick(draw, CKPT_OPTIMIZERS), steps=1 + draw(ints(1)), steps_after=draw(ints(2)))
    if api == "fsdp2" and maybe(draw, 1):  # requires_grad flips after the first step
        ck = dataclasses.replace(ck, refreeze=tuple(pick_subset(draw, m.params, min_size=1, max_size=2)))
    if maybe(draw, 2):  # resumed under another mask (the target's presets among them)
        ck = dataclasses.replace(ck, load_frozen=draw(model_freeze_masks(m.ref, freeze), label="load mask"))
    out = dataclasses.replace(case, ckpt=ck)
    if not lifecycle_fits(out):
        # a load plan the load-time mask rules out: the case's own plan, or
        # the other API with use_orig_params=True
        fallback = case.plan if load_api == api else WrapPlan(load_api, use_orig_params=True)
        if fallback.api == "fsdp1":
            fallback = dataclasses.replace(fallback, use_orig_params=True)
        out = dataclasses.replace(out, ckpt=dataclasses.replace(ck, load_plan=fallback))
    if per_parameter(out) and maybe(draw, 1):
        # the optimizer as training scripts build it (matrices, and the rest
        # at another learning rate without weight decay)
        out = dataclasses.replace(out, ckpt=dataclasses.replace(out.ckpt, param_groups=2))
    return out


def _with_schedule(draw, m: _Model, case: ModelCase) -> ModelCase:
    """1..2 optimizer steps of 1..2 microbatches (gradient sync off on all but
    the last, or on every one), freeze changes between steps where the API
    allows them, usually a mixed-precision setting."""
    api = case.plan.api
    can_change = api == "fsdp2" or case.plan.use_orig_params
    frozen = case.frozen
    steps = []
    for i in range(1 + draw(ints(1))):
        if i and can_change and maybe(draw, 1):  # progressive unfreezing, or freezing more
            flip = set(pick_subset(draw, m.params, min_size=1, max_size=3))
            frozen = tuple(f for f in m.params if (f in frozen) != (f in flip))
        mbs = tuple(Microbatch() for _ in range(1 + draw(ints(1))))
        steps.append(ScheduleStep(frozen, mbs, sync_every=not maybe(draw, 2)))
    pr = draw_precision(draw, api) if maybe(draw, 4) else None
    strategy = pick(draw, FSDP1_STRATEGIES) if api == "fsdp1" else "FULL_SHARD"  # the root's, every unit's
    return dataclasses.replace(case, schedule=Schedule(tuple(steps), optimizer=pick(draw, SCHEDULE_OPTIMIZERS), precision=pr,
                                                       sharding_strategy=strategy))


# ---- the natural configurations ------------------------------------------------------


def natural_model_cases(target: str, apis: Iterable[str] = APIS, lifecycle: str | None = None) -> list[ModelCase]:
    """The configurations the target's users run, checked first whatever the
    budget (explicit examples): under FSDP1 each wrap class as
    ModuleWrapPolicy and as transformer_auto_wrap_policy, with each
    trainable pattern's mask (nothing frozen when the target has none),
    either use_orig_params; under FSDP2 every module of each wrap class
    fully_shard-ed (torch's defaults) with each mask and every method
    registered. With a ``lifecycle``: the same plans with its plain form
    (the full state dict of get_model_state_dict, load_state_dict, a DCP
    save and resume on the same plan and world size with AdamW, bf16
    mixed precision with two accumulated microbatches), those FSDP
    promises to train only."""
    m = _model(target)
    apis = tuple(apis)
    masks = [m.frozen_for_trainable(lambda a, pats=pats: any(p in a for p in pats)) for pats in m.target.trainable_patterns] or [()]
    g = m.graph
    out: list[ModelCase] = []
    for cls in m.wrap_classes:
        if "fsdp1" in apis:
            for policy in (ModuleWrap((cls,)), TransformerWrap((cls,))):
                for frozen in masks:
                    for uop in (False, True):
                        out.append(ModelCase(target, 0, frozen, WrapPlan("fsdp1", policy, uop), train=TrainPlan()))
        if "fsdp2" in apis:
            layers = tuple(ShardGroup((p,)) for p in m.unit_modules if g.isinstance_of(g.resolve_module(p), (cls,)))
            methods = tuple(ForwardMethod("", mc.name) for mc in m.target.methods)
            for frozen in masks:
                out.append(ModelCase(target, 0, frozen, WrapPlan("fsdp2", groups=layers), methods, TrainPlan()))
    if lifecycle is None:
        return out
    lives = []
    for case in out:
        life = next((c for c in _natural_lifecycle(dataclasses.replace(case, methods=(), train=None), lifecycle) if lifecycle_fits(c)), None)
        if life is not None and life not in lives:
            lives.append(life)
    return lives


def _natural_lifecycle(case: ModelCase, lifecycle: str) -> list[ModelCase]:
    """The plain forms, most natural first (the first FSDP promises is used)."""
    if lifecycle == "full":
        return [dataclasses.replace(case, ckpt=CheckpointPlan())]
    if lifecycle == "ties":
        plan = case.plan if case.plan.api == "fsdp2" else dataclasses.replace(case.plan, use_orig_params=True)
        return [dataclasses.replace(case, plan=plan, ckpt=CheckpointPlan())]
    if lifecycle == "roundtrip":
        return [dataclasses.replace(case, ckpt=CheckpointPlan(optimizer="AdamW"))]
    step = ScheduleStep(case.frozen, (Microbatch(), Microbatch()))
    # bf16 where the model itself runs in it, else accumulation alone
    return [dataclasses.replace(case, schedule=Schedule((step,), optimizer="AdamW", precision=pr))
            for pr in (Precision("bfloat16", "float32"), None)]
