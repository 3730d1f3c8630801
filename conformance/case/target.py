"""Target: a real model the suite checks, and how its users use it.

A target stands where build.py stands for a synthetic case: every rank builds
the same fresh model from the seed, the strategies draw a plan (freeze mask,
wrap policy, FSDP2 grouping, registered methods) over its module graph, and
the invariants run unchanged. Targets are importable by name
("package.module:attr"), so a user points the suite at their own model
without touching the suite.
"""

from __future__ import annotations

import copy
import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from conformance.case.graph import ClassLookupError, ModelGraph, ParamInfo
from conformance.case.model_case import ModelCase

Inputs = Callable[[int], Mapping[str, Any]]  # seed -> keyword arguments


@dataclass(frozen=True)
class MethodCall:
    """A forward method users call instead of forward (e.g. ``generate``)."""

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)  # fixed keyword arguments
    inputs: Inputs | None = None  # seed -> keyword arguments; None: the target's inputs


@dataclass(frozen=True)
class Target:
    """How to build a model and how to use it.

    factory: seed -> a fresh module, deterministic (same seed, same values).
    inputs: seed -> keyword arguments of forward, deterministic.
    loss: forward's output -> a scalar tensor; None: ``output.loss`` when the
        output has one, else the sum of the output.
    methods: the forward methods users call (e.g. ``generate``).
    wrap_classes: classes that are natural wrap units (decoder layers), by
        name, or by qualified name ``module.QualName`` where two classes of
        the model share a name (PEFT's lora.Linear and torch's nn.Linear).
    trainable_patterns: "train only what matches" presets (LoRA: ("lora_",);
        BitFit: ("bias",)); a parameter trains when its FQN contains any of them.
    """

    name: str
    factory: Callable[[int], Any]
    inputs: Inputs
    loss: Callable[[Any], Any] | None = None
    methods: tuple[MethodCall, ...] = ()
    wrap_classes: tuple[str, ...] = ()
    trainable_patterns: tuple[tuple[str, ...], ...] = ()


def default_loss(output: Any):
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    if isinstance(output, Mapping) and output.get("loss") is not None:
        return output["loss"]
    logits = getattr(output, "logits", output)
    if isinstance(output, (tuple, list)):
        logits = output[0]
    return logits.float().sum()


def target_loss(target: Target, output: Any):
    """The target's loss of one forward's output (its own, else default_loss)."""
    return (target.loss or default_loss)(output)


class TargetError(ValueError):
    """A target that cannot be used; the message names the target and why."""


def load_target(ref: str) -> Target:
    """``package.module:attr``; attr is a Target or a zero-argument callable
    returning one."""
    mod_name, sep, attr = ref.partition(":")
    if not sep or not mod_name or not attr:
        raise TargetError(f"target {ref!r}: expected 'package.module:attr'")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # an import error of the user's code, whatever it is
        raise TargetError(f"target {ref!r}: cannot import {mod_name!r} ({type(e).__name__}: {e})") from None
    try:
        obj = getattr(mod, attr)
    except AttributeError:
        raise TargetError(f"target {ref!r}: module {mod_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, Target) and callable(obj):
        try:
            obj = obj()
        except Exception as e:
            raise TargetError(f"target {ref!r}: calling {attr}() raised {type(e).__name__}: {e}") from None
    if not isinstance(obj, Target):
        raise TargetError(f"target {ref!r}: {attr!r} is a {type(obj).__name__}, not a conformance.Target")
    return obj


# ---- model cases: build, graph, checks ----------------------------------------
# (Below: what the engine, the oracle and the strategies need from a target.
# The graph is built in the driver from one model; ranks build their own.)



@functools.lru_cache(maxsize=32)
def cached_target(ref: str) -> Target:
    """load_target, once per process (ranks build many cases of one target)."""
    return load_target(ref)


def _fail(ref: str, what: str) -> TargetError:
    return TargetError(f"target {ref!r}: {what}")


def make_model(ref: str, seed: int):
    """The target's fresh model for ``seed`` (TargetError if the factory fails)."""
    target = cached_target(ref)
    try:
        model = target.factory(seed)
    except Exception as e:
        raise _fail(ref, f"factory({seed}) raised {type(e).__name__}: {_first_line(e)}") from None
    if not isinstance(model, nn.Module):
        raise _fail(ref, f"factory({seed}) returned a {type(model).__name__}, not an nn.Module")
    return model


def apply_freeze(model, frozen) -> None:
    """requires_grad=False for the FQNs in ``frozen`` (any alias), True for
    every other parameter: the mask alone decides."""
    frozen = set(frozen)
    names: dict[int, list[str]] = {}
    params = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
        params[id(p)] = p
    for pid, p in params.items():
        p.requires_grad_(not (frozen & set(names[pid])))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


@functools.lru_cache(maxsize=32)
def base_graph(ref: str):
    """The target's module graph (seed 0, the factory's own requires_grad).
    A target's structure must not depend on the seed; its values do."""
    model = make_model(ref, 0)
    g = ModelGraph(model)
    g.not_called = modules_not_called(ref, model)
    return g


def modules_not_called(ref: str, model) -> frozenset[str]:
    """Canonical paths of the modules (root excluded) whose forward the
    model's forward never runs on the target's inputs, found with forward
    pre-hooks on an unsharded model. Empty when forward fails (check_target
    reports that)."""
    called: set[int] = set()
    handles = [m.register_forward_pre_hook(lambda mod, args: called.add(id(mod))) for m in model.modules()]
    try:
        with torch.no_grad():
            model(**dict(cached_target(ref).inputs(0)))
    except Exception:
        return frozenset()
    finally:
        for h in handles:
            h.remove()
    seen: set[int] = set()
    out = []
    for path, m in model.named_modules():
        if path and id(m) not in seen and id(m) not in called:
            out.append(path)
        seen.add(id(m))
    return frozenset(out)


def graph_of(case):
    """The graph the oracle reads: a CaseSpec's own, or a ModelCase's target
    graph with the case's freeze mask applied."""
    if not isinstance(case, ModelCase):
        return _spec_graph(case)
    return _masked_graph(case.target, frozenset(case.frozen))


@functools.lru_cache(maxsize=256)
def _spec_graph(spec):
    return ModelGraph(spec)


@functools.lru_cache(maxsize=256)
def _masked_graph(ref: str, frozen: frozenset):

    g = copy.copy(base_graph(ref))
    g.param_info = {
        pid: ParamInfo(info.shape, not (frozen & set(g.aliases(pid))))
        for pid, info in base_graph(ref).param_info.items()
    }
    return g


def check_case(case) -> None:
    """TargetError unless every name the ModelCase's plan uses exists in the
    target's model (FQNs, module paths, class names, method names)."""
    target = cached_target(case.target)
    g = base_graph(case.target)
    ref = case.target
    fqns = {a for pid in g.param_info for a in g.aliases(pid)}
    paths = set(g.module_path.values())  # canonical: what the adapters look modules up by
    for f in case.frozen:
        if f not in fqns:
            raise _fail(ref, f"the freeze mask names {f!r}, not a parameter of the model")
    plans = [case.plan] + ([case.ckpt.load_plan] if case.ckpt is not None and case.ckpt.load_plan is not None else [])
    for plan in plans:
        _check_plan(ref, g, plan, fqns, paths)
    canonical = set(g.param_fqn.values())  # the lifecycle's masks name each parameter by its canonical FQN
    lifecycle = []
    if case.ckpt is not None:
        lifecycle += [("the checkpoint plan", f) for f in case.ckpt.refreeze + (case.ckpt.load_frozen or ())]
    if case.schedule is not None:
        lifecycle += [("the schedule", f) for st in case.schedule.steps for f in st.frozen]
    for what, f in lifecycle:
        if f not in canonical:
            raise _fail(ref, f"{what} names {f!r}, not the canonical FQN of a parameter of the model")
    names = {m.name for m in target.methods}
    for m in case.methods:
        if m.name not in names:
            raise _fail(ref, f"the case calls method {m.name!r}, which the target does not list")


def _check_plan(ref: str, g, plan, fqns: set[str], paths: set[str]) -> None:
    pol = plan.policy
    for c in getattr(pol, "classes", ()):
        try:
            g.resolve_class(c)
        except ClassLookupError as e:
            raise _fail(ref, f"the wrap policy's class {c!r} {e}") from None
    for p in getattr(pol, "targets", ()):
        if p not in paths:
            raise _fail(ref, f"the wrap policy names module {p!r}, not a module of the model")
    for grp in plan.groups:
        for p in grp.modules:
            if p not in paths:
                raise _fail(ref, f"the shard group names module {p!r}, not a module of the model")
    for p in plan.ignored_modules:
        if p not in paths or p == "":
            raise _fail(ref, f"ignored module {p!r} is not a non-root module of the model")
    for f in plan.ignored_params:
        if f not in fqns:
            raise _fail(ref, f"ignored parameter {f!r} is not a parameter of the model")


def check_target(ref: str, *, wrap_classes: tuple[str, ...] | None = None) -> Target:
    """Load the target and try it once, unsharded: the factory builds a
    module with parameters; its forward takes the inputs; the loss is a
    scalar; each listed method exists and runs; its wrap classes are classes
    of the model. TargetError (naming the target and what is wrong) otherwise."""
    target = load_target(ref)
    cached_target.cache_clear()
    model = make_model(ref, 0)
    if not any(True for _ in model.parameters()):
        raise _fail(ref, "the model has no parameters")
    try:
        inputs = dict(target.inputs(0))
    except Exception as e:
        raise _fail(ref, f"inputs(0) raised {type(e).__name__}: {_first_line(e)}") from None
    try:
        out = model(**inputs)
    except Exception as e:
        raise _fail(ref, f"the model rejects its inputs: forward raised {type(e).__name__}: {_first_line(e)}") from None
    try:
        loss = (target.loss or default_loss)(out)
        ok = isinstance(loss, torch.Tensor) and loss.numel() == 1
    except Exception as e:
        raise _fail(ref, f"the loss raised {type(e).__name__}: {_first_line(e)}") from None
    if not ok:
        raise _fail(ref, "the loss is not a scalar tensor")
    for mc in target.methods:
        fn = getattr(model, mc.name, None)
        if not callable(fn):
            raise _fail(ref, f"the model has no method {mc.name!r}")
        try:
            with torch.no_grad():
                fn(**method_kwargs(target, mc, 0))
        except Exception as e:
            raise _fail(ref, f"method {mc.name}() raised {type(e).__name__}: {_first_line(e)}") from None
    g = base_graph(ref)
    for c in (target.wrap_classes if wrap_classes is None else wrap_classes):
        try:
            g.resolve_class(c)
        except ClassLookupError as e:
            raise _fail(ref, f"wrap class {c!r} {e}") from None
    return target


def method_kwargs(target: Target, mc: MethodCall, seed: int) -> dict:
    """The keyword arguments of one call of ``mc``: its inputs (or the
    target's), then its fixed kwargs."""
    base = dict((mc.inputs or target.inputs)(seed))
    base.update(mc.kwargs)
    return base


@functools.lru_cache(maxsize=32)
def methods_calling_forward(ref: str) -> frozenset[str]:
    """Names of the target's methods that call the model itself (self(...),
    as HF generate does), found by running each once on an unsharded model
    with a forward pre-hook on the root: a fact about the model that the
    oracle's tags need (register_fsdp_forward_method's hooks then nest)."""
    target = cached_target(ref)
    model = make_model(ref, 0)
    count = [0]
    handle = model.register_forward_pre_hook(lambda mod, args: count.__setitem__(0, count[0] + 1))
    out = set()
    try:
        for mc in target.methods:
            count[0] = 0
            with torch.no_grad():
                getattr(model, mc.name)(**method_kwargs(target, mc, 0))
            if count[0]:
                out.add(mc.name)
    finally:
        handle.remove()
    return frozenset(out)


@functools.lru_cache(maxsize=32)
def params_without_grad(ref: str) -> frozenset[str]:
    """Canonical FQNs of the parameters whose gradient stays None after one
    backward of the target's loss on its inputs (seed 0), every parameter
    trainable, on an unsharded model: the parameters the loss does not use
    (a pooler an MLM loss never reads), a fact of the model the oracle
    needs (FSDP1 reduces whole flat parameters: those get zero gradients,
    not None). Empty when forward or backward fails (check_target reports
    that)."""
    target = cached_target(ref)
    model = make_model(ref, 0)
    for p in model.parameters():
        p.requires_grad_(True)
    try:
        target_loss(target, model(**dict(target.inputs(0)))).backward()
    except Exception:
        return frozenset()
    g = ModelGraph(model)
    by_id = {id(p): p for p in model.parameters()}
    seen = {}
    for fqn, p in model.named_parameters():
        seen.setdefault(id(p), fqn)
    return frozenset(g.param_fqn.get(fqn, fqn) for pid, fqn in seen.items() if by_id[pid].grad is None)


@functools.lru_cache(maxsize=64)
def runs_in(ref: str, param_dtype: str, buffer_dtype: str | None = None) -> str:
    """Whether the target's unsharded model runs its forward and loss with
    its parameters in ``param_dtype`` (torch.<name>), its floating inputs
    too, and its floating buffers in ``buffer_dtype`` (None: as they are):
    "" if so, else "Type: first line" of what raised. A model whose own
    arithmetic does not survive the cast (a float32 buffer times a bf16
    activation into a bf16 LayerNorm) cannot be trained under mixed
    precision whatever FSDP does: a fact of the model, found by running it."""
    target = cached_target(ref)
    model = make_model(ref, 0)
    dtype = getattr(torch, param_dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)
        if buffer_dtype is not None:
            for m in model.modules():
                for n, b in m._buffers.items():
                    if b is not None and b.is_floating_point():
                        m._buffers[n] = b.to(getattr(torch, buffer_dtype))
    inputs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in dict(target.inputs(0)).items()}
    try:
        with torch.no_grad():
            target_loss(target, model(**inputs)).float()
    except Exception as e:
        return f"{type(e).__name__}: {_first_line(e)}"
    return ""
