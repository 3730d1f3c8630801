"""Target: a real model the suite checks, and how its users use it.

A target stands where build.py stands for a synthetic case: every rank builds
the same fresh model from the seed, the strategies draw a plan (freeze mask,
wrap policy, FSDP2 grouping, registered methods) over its module graph, and
the invariants run unchanged. Targets are importable by name
("package.module:attr"), so a user points the suite at their own model
without touching the suite.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

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
    wrap_classes: class names that are natural wrap units (decoder layers).
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
        raise TargetError(f"target {ref!r}: {attr!r} is a {type(obj).__name__}, not a conformance.targets.Target")
    return obj
