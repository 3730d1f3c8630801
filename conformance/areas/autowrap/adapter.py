"""FSDP1 adapter: wrap a built case with FullyShardedDataParallel and observe
what it did. The only module that reads FSDP1's private state."""

from __future__ import annotations

import ast
import re
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

# read through the module at call time: a fault test (or a mutant) replaces these helpers
from torch.distributed.fsdp import _wrap_utils
from torch.distributed.fsdp.wrap import _Policy

from conformance.areas.autowrap.observation import FROZEN_MARK, FrozenMessage, UnitObservation, WrapObservation
from conformance.areas.common.fsdp1_adapter import Aliases, clean, error_text, make_policy, wrap
from conformance.areas.common.ranks import all_ranks_equal
from conformance.areas.common.support import placed
from conformance.case.build import build
from conformance.case.spec import CaseSpec

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

    if policy is not None and not isinstance(policy, _Policy):
        return None
    ignored_modules = {m for path in spec.plan.ignored_modules for m in model.get_submodule(path).modules()}
    targets = set(policy._run_policy(model, ignored_modules, {}) if policy is not None else ()) | {model}
    ignored = _ignored_params(spec, model)
    visited: set[nn.Module] = set()
    out: dict[str, tuple[str, ...]] = {}
    for name, module in _wrap_utils._get_post_order_named_modules(model):
        if module in targets:
            managed = _wrap_utils._get_managed_param_to_fqn(module, ignored, visited, name)
            out[aliases.canon_of_module[id(module)]] = tuple(aliases.canon_of_param.get(id(p), fqn) for p, fqn in managed.items())
    return out


def post_order_names(model: nn.Module) -> list[str]:
    """The module order torch's frozen-parameter check walks (spec source 000)."""

    return [name for name, _ in _wrap_utils._get_post_order_named_modules(model)]


def _ignored_params(spec: CaseSpec, model: nn.Module) -> set[nn.Parameter]:
    out = {p for path in spec.plan.ignored_modules for p in model.get_submodule(path).parameters()}
    out.update(model.get_parameter(f) for f in spec.plan.ignored_params)
    return out


def observe(spec: CaseSpec, *, with_simulation: bool = True, with_state_dict: bool = True) -> WrapObservation:
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
        # Every rank takes part in the structure check, this one too: a wrap
        # that raised on some ranks only (rank-dependent units) would leave
        # the others waiting in it, a HANG instead of the ranks' disagreement
        # that RANKS-AGREE reports.
        _same_structure_on_all_ranks("the wrap raised")
        return WrapObservation(**base, error=error, warnings=frozen_warnings, other_warnings=other, wrap_seconds=wrap_seconds)

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
    if not _same_structure_on_all_ranks([(u.path, u.managed) for u in unit_obs]):
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
    return WrapObservation(
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


def _same_structure_on_all_ranks(mine) -> bool:
    """Whether every rank built what this one did (its units, or a wrap that
    raised): one all-reduce that every rank reaches (ranks.all_ranks_equal)."""
    return all_ranks_equal(mine)


def _get_attr(model: nn.Module, path: str):
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part)  # FSDP1 forwards attribute access to the wrapped module
    return obj
