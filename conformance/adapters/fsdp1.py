"""FSDP1 adapter: wrap a built case with FullyShardedDataParallel and observe
what it did. The only module that reads FSDP1's private state."""

from __future__ import annotations

import ast
import functools
import re
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from conformance.case.build import Built, build
from conformance.adapters.support import placed, rank_device
from conformance.observations import FROZEN_MARK, FrozenMessage, Observation, UnitObservation
from conformance.case.spec import CaseSpec, CustomWrap, LambdaWrap, ModuleWrap, SizeBasedWrap, TransformerWrap

FSDP_PREFIX = "_fsdp_wrapped_module."


def clean(name: str) -> str:
    return name.replace(FSDP_PREFIX, "").replace("._fsdp_wrapped_module", "").replace("_fsdp_wrapped_module", "")


def make_policy(spec: CaseSpec, built: Built):
    """The torch auto_wrap_policy object for the spec's WrapPlan."""
    pol = spec.plan.policy
    if pol is None:
        return None
    if isinstance(pol, ModuleWrap):
        return ModuleWrapPolicy({built.classes[c] for c in pol.classes})
    if isinstance(pol, TransformerWrap):
        return functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={built.classes[c] for c in pol.classes}
        )
    paths = built.module_paths()
    if isinstance(pol, SizeBasedWrap):
        return functools.partial(size_based_auto_wrap_policy, min_num_params=pol.min_num_params)
    if isinstance(pol, LambdaWrap):
        targets = set(pol.targets)
        return functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: paths.get(id(m)) in targets)
    if isinstance(pol, CustomWrap):
        kwargs = {t: dict(kw) for t, kw in pol.kwargs}
        targets = set(pol.targets)

        def lambda_fn(m: nn.Module):
            path = paths.get(id(m))
            if path not in targets:
                return False
            kw = dict(kwargs.get(path, {}))
            if "sharding_strategy" in kw:
                kw["sharding_strategy"] = ShardingStrategy[kw["sharding_strategy"]]
            return kw or True

        return CustomPolicy(lambda_fn)
    raise TypeError(f"unknown policy {pol!r}")


class Aliases:
    """Canonical names of the unwrapped model's modules and parameters."""

    def __init__(self, model: nn.Module):
        self.module_canon: dict[str, str] = {}  # any path -> canonical path
        self.canon_of_module: dict[int, str] = {}  # id(module) -> canonical path
        for path, m in model.named_modules(remove_duplicate=False):
            self.canon_of_module.setdefault(id(m), path)
            self.module_canon[path] = self.canon_of_module[id(m)]
        self.param_canon: dict[str, str] = {}  # any FQN -> canonical FQN
        self.canon_of_param: dict[int, str] = {}  # id(param) -> canonical FQN
        self.by_slot: dict[tuple[int, str], str] = {}  # (id(module), name) -> canonical FQN
        for fqn, p in model.named_parameters(remove_duplicate=False):
            self.canon_of_param.setdefault(id(p), fqn)
            self.param_canon[fqn] = self.canon_of_param[id(p)]
        for path, m in model.named_modules(remove_duplicate=False):
            for name, p in m._parameters.items():
                if p is not None:
                    self.by_slot[(id(m), name)] = self.canon_of_param[id(p)]
        groups: dict[str, list[str]] = {}
        for fqn, canon in self.param_canon.items():
            groups.setdefault(canon, []).append(fqn)
        self.tied = {c: names for c, names in groups.items() if len(names) > 1}


_LIST = r"(\[.*?\])"
_FROZEN_RE = re.compile(
    r"^(?P<module>.*?) " + FROZEN_MARK + r"\.(?P<body>.*)"
    r"The following parameters have requires_grad=True:\n" + _LIST + r"\n"
    r"The following parameters have requires_grad=False:\n" + _LIST + r"\s*$",
    re.S,
)
_NUMEL_RE = re.compile(r"\((\d+) numel instead of (\d+) numel")


def parse_frozen_message(category: str, text: str, aliases: Aliases) -> FrozenMessage:
    """Parse torch's frozen-parameter error/warning text; names become canonical."""
    m = _FROZEN_RE.match(text)
    if not m:
        return FrozenMessage(category, text, None, None, None, None, None)
    n = _NUMEL_RE.search(m.group("body"))

    def names(lst: str) -> tuple[str, ...]:
        try:
            return tuple(aliases.param_canon.get(x, x) for x in ast.literal_eval(lst))
        except (ValueError, SyntaxError):
            return ()

    module = m.group("module")
    return FrozenMessage(
        category=category,
        text=text,
        module=aliases.module_canon.get(module, module),
        total_numel=int(n.group(1)) if n else None,
        trainable_numel=int(n.group(2)) if n else None,
        trainable=names(m.group(3)),
        frozen=names(m.group(4)),
    )


def _unit_managed(unit: FSDP, aliases: Aliases) -> tuple[tuple[str, ...], tuple[str, ...]]:
    handle = unit._handle
    if handle is None:
        return (), ()
    fp = handle.flat_param
    canon = [aliases.by_slot.get((id(info.module), info.param_name), info.param_name) for info in fp._param_infos]
    return tuple(canon), tuple(fp._fqns)


def simulate(spec: CaseSpec, model: nn.Module, policy, aliases: Aliases) -> dict[str, tuple[str, ...]] | None:
    """torch's own pre-wrap simulation, run as _validate_frozen_params runs it
    (same helpers, the policy's _run_policy targets), plus the root, which is
    always a unit. Call before wrapping. None for callable policies: torch
    does not simulate them."""
    from torch.distributed.fsdp._wrap_utils import _get_managed_param_to_fqn, _get_post_order_named_modules
    from torch.distributed.fsdp.wrap import _Policy

    if policy is not None and not isinstance(policy, _Policy):
        return None
    ignored_modules = {m for path in spec.plan.ignored_modules for m in model.get_submodule(path).modules()}
    targets = set(policy._run_policy(model, ignored_modules, {}) if policy is not None else ()) | {model}
    ignored = _ignored_params(spec, model)
    visited: set[nn.Module] = set()
    out: dict[str, tuple[str, ...]] = {}
    for name, module in _get_post_order_named_modules(model):
        if module in targets:
            managed = _get_managed_param_to_fqn(module, ignored, visited, name)
            out[aliases.canon_of_module[id(module)]] = tuple(aliases.canon_of_param.get(id(p), fqn) for p, fqn in managed.items())
    return out


def post_order_names(model: nn.Module) -> list[str]:
    """The module order torch's frozen-parameter check walks (spec source 000)."""
    from torch.distributed.fsdp._wrap_utils import _get_post_order_named_modules

    return [name for name, _ in _get_post_order_named_modules(model)]


def _ignored_params(spec: CaseSpec, model: nn.Module) -> set[nn.Parameter]:
    out = {p for path in spec.plan.ignored_modules for p in model.get_submodule(path).parameters()}
    out.update(model.get_parameter(f) for f in spec.plan.ignored_params)
    return out


def error_text(e: BaseException) -> str:
    """The text of a wrapping error. Older torch (2.4.1 and 2.6.0 measured) asserts in
    _recursive_wrap that no child is already wrapped without a message
    (later releases say "Child module ... is already wrapped by ..."): the same
    rejection gets the same words here, whatever the release."""
    text = str(e)
    if text:
        return text
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, AssertionError) and frames and frames[-1].name == "_recursive_wrap" and "isinstance(child" in (frames[-1].line or ""):
        return "Child module is already wrapped (_recursive_wrap's assertion, without a message in this torch)"
    return f"{type(e).__name__} without a message"


def wrap(spec: CaseSpec, built: Built, policy=None, **extra) -> FSDP:
    """FSDP1 over the case's plan; ``extra``: more FSDP kwargs (mixed_precision)."""
    model = built.model
    kwargs = dict(
        auto_wrap_policy=make_policy(spec, built) if policy is None else policy,
        device_id=rank_device(),
        use_orig_params=spec.plan.use_orig_params,
        **extra,
    )
    if spec.plan.ignored_modules:
        kwargs["ignored_modules"] = [model.get_submodule(p) for p in spec.plan.ignored_modules]
    if spec.plan.ignored_params:
        kwargs["ignored_states"] = [model.get_parameter(f) for f in spec.plan.ignored_params]
    return FSDP(model, **kwargs)


def observe(spec: CaseSpec, *, with_simulation: bool = True, with_state_dict: bool = True) -> Observation:
    """Wrap the case with FSDP1 on the current default process group."""
    built = placed(build(spec))
    aliases = Aliases(built.model)
    policy = make_policy(spec, built)
    sim = simulate(spec, built.model, policy, aliases) if with_simulation else None
    base = dict(
        api="fsdp1",
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        torch_version=torch.__version__,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        try:
            wrapped = wrap(spec, built, policy)
            error = None
        except Exception as e:  # an FSDP rejection is an observation, not a crash
            wrapped = None
            error = parse_frozen_message(type(e).__name__, error_text(e), aliases)
        wrap_seconds = time.perf_counter() - t0
    frozen_warnings = tuple(
        parse_frozen_message(w.category.__name__, str(w.message), aliases) for w in caught if FROZEN_MARK in str(w.message)
    )
    other = tuple(str(w.message) for w in caught if FROZEN_MARK not in str(w.message))
    if wrapped is None:
        return Observation(**base, error=error, warnings=frozen_warnings, other_warnings=other, wrap_seconds=wrap_seconds)

    units = []
    for unit in FSDP.fsdp_modules(wrapped):
        path = aliases.canon_of_module.get(id(unit.module), "?")
        managed, raw = _unit_managed(unit, aliases)
        raw = tuple(f"{path}.{n}" if path else n for n in raw)
        units.append((path, managed, raw, _unit_kwargs(unit)))
    unit_obs = tuple(
        UnitObservation(path=p, managed=m, raw_managed=r, simulated=None if sim is None else sim.get(p), kwargs=kw)
        for p, m, r, kw in units
    )
    state_dict_keys, state_dict_error, state_dict_seconds = (), None, 0.0
    if not _same_structure_on_all_ranks(unit_obs):
        # Ranks built different units: any further collective (state_dict's
        # all-gathers) would be mismatched and abort the group.
        with_state_dict = False
        state_dict_error = "skipped: the ranks built different FSDP units"
    if with_state_dict:
        t0 = time.perf_counter()
        try:
            state_dict_keys = tuple(clean(k) for k in wrapped.state_dict().keys())
        except Exception as e:  # FSDP broke after wrapping: an observation
            state_dict_error = f"{type(e).__name__}: {e}"
        state_dict_seconds = time.perf_counter() - t0
    named = ()
    ties = ()
    if spec.plan.use_orig_params:
        named = tuple(clean(n) for n, _ in wrapped.named_parameters())
        ties = tuple(
            (canon, len({id(_get_attr(wrapped, n)) for n in names}) == 1) for canon, names in sorted(aliases.tied.items())
        )
    return Observation(
        **base,
        units=unit_obs,
        warnings=frozen_warnings,
        other_warnings=other,
        state_dict_keys=state_dict_keys,
        state_dict_error=state_dict_error,
        named_parameters=named,
        ties_intact=ties,
        wrap_seconds=wrap_seconds,
        state_dict_seconds=state_dict_seconds,
    )


def _unit_kwargs(unit) -> tuple:
    """The kwargs of spec.CUSTOM_KWARGS as the unit holds them (FSDP1 keeps
    them on its _FSDPState: sharding_strategy, forward_prefetch)."""
    strategy = getattr(unit, "sharding_strategy", None)
    return (
        ("forward_prefetch", bool(getattr(unit, "forward_prefetch", False))),
        ("sharding_strategy", getattr(strategy, "name", str(strategy))),
    )


def _same_structure_on_all_ranks(units) -> bool:
    if dist.get_backend() == "fake" or dist.get_world_size() == 1:
        return True  # one real rank: nothing to disagree with
    mine = [(u.path, u.managed) for u in units]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return all(x == mine for x in everyone)


def _get_attr(model: nn.Module, path: str):
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part)  # FSDP1 forwards attribute access to the wrapped module
    return obj
