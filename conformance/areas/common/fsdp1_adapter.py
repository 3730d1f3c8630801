"""FSDP1 as the areas apply it: the torch auto_wrap_policy of a WrapPlan,
FullyShardedDataParallel over a built case, and the canonical names of the
unwrapped model (FSDP1 internals read here are the wrapper prefix only)."""

from __future__ import annotations

import functools
import traceback

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

from conformance.areas.common.support import rank_device
from conformance.case.build import Built
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


def flat_layout(flat) -> list[tuple[str | None, int]]:
    """A flat parameter's entries in flat order: (the original parameter's
    FQN relative to its unit, numel), or (None, numel) for alignment padding
    (use_orig_params=True aligns each parameter; False packs them). The
    final padding to a multiple of the world size is not an entry
    (internals: _fqns, _numels, _numels_with_padding, _is_padding_mask)."""
    mask, numels = getattr(flat, "_is_padding_mask", None), getattr(flat, "_numels_with_padding", None)
    if not mask or numels is None:
        return list(zip(flat._fqns, flat._numels))
    fqns = iter(flat._fqns)
    return [(None if padding else next(fqns), numel) for padding, numel in zip(mask, numels)]
