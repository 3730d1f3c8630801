"""ModelCase: one conformance case on a real model (a Target), as pure data.

It names the target ("package.module:attr") and the seed, and holds the plan
drawn over the model's own graph, in CaseSpec's plan types: the freeze mask
(FQNs), the WrapPlan (policy by class names or module paths, CustomWrap
per-module kwargs, size threshold, use_orig_params, FSDP2 groups with
reshard_after_forward), the target's methods to call (ForwardMethod with no
steps: their bodies are the model's own) and which of them to register, an
optional TrainPlan, and the lifecycle: a CheckpointPlan (refreeze and
load_frozen by canonical FQN) and a Schedule (mixed precision, accumulation;
a real model's forward is its own: no microbatch skips a module, and the
first microbatch is a forward). It crosses process boundaries as JSON like a CaseSpec;
each rank imports the target and builds the model from the seed.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from conformance.case import spec as _spec
from conformance.case.spec import (
    CUSTOM_KWARGS,
    OPTIMIZERS,
    POLICY_TYPES,
    CaseSpec,
    CheckpointPlan,
    CustomWrap,
    ForwardMethod,
    MethodCall,
    Schedule,
    SpecError,
    TrainPlan,
    WrapPlan,
    validate_ckpt_plan,
    validate_schedule_plan,
)

MODEL_CASE_VERSION = 1


@dataclass(frozen=True)
class ModelCase:
    target: str  # "package.module:attr"
    seed: int = 0
    frozen: tuple[str, ...] = ()  # canonical FQNs with requires_grad=False; every other parameter trains
    plan: WrapPlan = field(default_factory=WrapPlan)
    # The target's methods, root-level (e.g. generate), called after one
    # forward; register: passed to register_fsdp_forward_method (FSDP2).
    methods: tuple[ForwardMethod, ...] = ()
    train: TrainPlan | None = None
    ckpt: CheckpointPlan | None = None  # SD-FULL, TIES-KEPT, CKPT-RESHARD, OPTIM-STATE
    schedule: Schedule | None = None  # MP-DTYPES, ACCUM

    def __post_init__(self) -> None:
        validate_model_case(self)

    # What code written for CaseSpecs reads; a model case has no drawn tree.
    @property
    def shared(self) -> tuple:
        return ()

    @property
    def ties(self) -> tuple:
        return ()

    @property
    def calls(self) -> tuple[MethodCall, ...]:
        """One forward (lazy init picks the root by it), then each method once."""
        return (MethodCall(-1),) + tuple(MethodCall(i) for i in range(len(self.methods)))

    @property
    def target_name(self) -> str:
        return self.target

    def size(self) -> tuple[int, int]:
        """How big a case is, for keeping the smallest: frozen parameters,
        then the length of the JSON."""
        return len(self.frozen), len(self.to_json())

    # -- JSON ---------------------------------------------------------------
    def to_json(self) -> str:
        return self._json

    @functools.cached_property
    def _json(self) -> str:
        return json.dumps({"version": MODEL_CASE_VERSION, "model_case": _spec.encode(self)}, sort_keys=True)

    def __getstate__(self) -> dict:
        # pickled (the rank pool ships cases so): without the cached JSON
        return {k: v for k, v in self.__dict__.items() if k != "_json"}

    @classmethod
    def from_json(cls, text: str) -> "ModelCase":
        return _spec.load_json(text, ModelCase, MODEL_CASE_VERSION, "model_case", types=(ModelCase,))

    def to_python(self) -> str:
        return "from conformance.case.spec import *\nfrom conformance.case.model_case import ModelCase\n\nspec = " + repr(self) + "\n"




def is_model_case(case) -> bool:
    return isinstance(case, ModelCase)


def case_from_json(text: str):
    """A CaseSpec or a ModelCase, whichever the JSON holds."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"case JSON is not valid JSON: {e}") from None
    if isinstance(data, dict) and "model_case" in data:
        return ModelCase.from_json(text)
    return CaseSpec.from_json(text)


def case_from_dict(data: dict):
    """As case_from_json, for the parsed JSON (a report's finding)."""
    return case_from_json(json.dumps(data))


def validate_model_case(case: ModelCase) -> None:
    """What can be checked without importing the target (the rest:
    conformance.case.target.check_case, against the model's graph)."""
    mod, sep, attr = case.target.partition(":")
    if not isinstance(case.target, str) or not sep or not mod or not attr:
        raise SpecError(f"ModelCase.target must be 'package.module:attr', got {case.target!r}")
    if not isinstance(case.seed, int):
        raise SpecError("ModelCase.seed must be an int")
    if len(set(case.frozen)) != len(case.frozen):
        raise SpecError("ModelCase.frozen names a parameter twice")
    _validate_plan(case.plan)
    _validate_lifecycle(case)


def _validate_plan(plan) -> None:
    if not isinstance(plan, WrapPlan) or plan.api not in ("fsdp1", "fsdp2"):
        raise SpecError(f"ModelCase.plan must be a WrapPlan with api fsdp1 or fsdp2, got {plan!r}")
    pol = plan.policy
    if pol is not None and not isinstance(pol, POLICY_TYPES):
        raise SpecError(f"unknown policy {pol!r}")
    if isinstance(pol, CustomWrap):
        for t, kw in pol.kwargs:
            if t not in pol.targets:
                raise SpecError(f"CustomWrap kwargs for {t!r}, which is not a target")
            for k, v in kw:
                if k not in CUSTOM_KWARGS or v not in CUSTOM_KWARGS[k]:
                    raise SpecError(f"CustomWrap kwarg {k}={v!r} is not supported")
    if plan.groups and plan.api != "fsdp2":
        raise SpecError("shard groups are for api='fsdp2'")
    seen: set[str] = set()
    for g in plan.groups:
        if not g.modules or seen & set(g.modules) or len(set(g.modules)) != len(g.modules):
            raise SpecError(f"shard group {g!r}: no module, or a module in two groups")
        if len(g.modules) > 1 and "" in g.modules:
            raise SpecError(f"shard group {g!r}: the root is sharded on its own")
        seen.update(g.modules)


def _validate_lifecycle(case: ModelCase) -> None:
    names = [m.name for m in case.methods]
    if len(set(names)) != len(names):
        raise SpecError("ModelCase.methods names a method twice")
    for m in case.methods:
        if m.module != "" or m.steps:
            raise SpecError(f"ModelCase method {m.name!r}: a target's methods are the root's own (module '', no steps)")
    t = case.train
    if t is not None and (t.optimizer not in OPTIMIZERS or t.steps < 1 or not t.lr > 0):
        raise SpecError(f"train plan {t!r}: optimizer one of {OPTIMIZERS}, steps >= 1, lr > 0")
    if case.ckpt is not None:
        # the FQNs it names are checked against the model (check_case)
        validate_ckpt_plan(case.ckpt, case.plan)
        if case.ckpt.load_plan is not None:
            _validate_plan(case.ckpt.load_plan)
            if case.ckpt.load_plan.ignored_modules or case.ckpt.load_plan.ignored_params:
                raise SpecError("a checkpoint's load plan ignores nothing")
    s = case.schedule
    if s is not None:
        validate_schedule_plan(s, case.plan.api)
        if any(mb.skip for st in s.steps for mb in st.microbatches):
            raise SpecError("schedule: a real model's forward is its own; no microbatch skips a module")
        if s.first != -1:
            raise SpecError("schedule: a real model's first microbatch is a forward (first=-1)")
