"""Invariants as the areas declare them: ID, group, API, statement, spec
source and check, one ``Catalog`` per area's invariants module."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

S000 = "spec-sources/000 ([FSDP][6/N] Check valid param freezing for ModuleWrapPolicy, #104427)"
S004 = "spec-sources/004 ([RFC][FSDP2] register_fsdp_forward_method, #125394)"
DOC_FSDP = "FullyShardedDataParallel docstring (auto_wrap_policy, ignored_modules, use_orig_params)"


@dataclass(frozen=True)
class Invariant:
    id: str
    group: str  # the catalog section it is listed and selected under: wrap, frozen, ties, ...
    api: str  # fsdp1 | fsdp2 | fsdp1|fsdp2
    statement: str
    source: str
    check: Callable  # (spec, prediction, observation) -> list[Violation] | NotChecked
    all_ranks: bool = False  # check gets every rank's observation, not rank 0's
    scenario: str = ""  # the area's scenario that observes what it checks
    area: str = ""  # the area package that declares it (set by its Area record)

    @property
    def apis(self) -> tuple[str, ...]:
        return tuple(self.api.split("|"))


@dataclass(frozen=True)
class NotChecked:
    """What a check returns when the example gave it nothing to compare
    (the case is outside the promise, the tier carries no values, ...): the
    example is recorded as not checked, with the reason, never as a PASS."""

    reason: str


# A value comparison on a tier whose collectives carry no data (the fake
# process group): the example compared no values.
VALUES_UNCHECKED = NotChecked("values are not compared on the fake tier (its collectives carry no data)")


class UnknownInvariant(KeyError):
    """A name that is no invariant ID, group or area; ``known`` for the message."""

    def __init__(self, name: str, known: list[str] | tuple[str, ...] = ()):
        super().__init__(name)
        self.known = tuple(known)

    def __str__(self) -> str:
        return f"unknown invariant ID {self.args[0]!r} (known: {', '.join(sorted(set(self.known)))})"


class Catalog:
    """The invariants one area's invariants module declares, in order:
    ``@catalog.invariant("ID", ...)`` over each check."""

    def __init__(self) -> None:
        self.invariants: list[Invariant] = []

    def invariant(self, id: str, *, group: str, api: str, statement: str, source: str, scenario: str,
                  all_ranks: bool = False) -> Callable[[Callable], Callable]:
        def declare(fn: Callable) -> Callable:
            if any(i.id == id for i in self.invariants):
                raise ValueError(f"duplicate invariant {id}")
            self.invariants.append(Invariant(id, group, api, statement, source, _own_violations(id, fn), all_ranks, scenario))
            return fn

        return declare


def _own_violations(invariant_id: str, check: Callable) -> Callable:
    """``check``, held to its catalog entry: every violation it returns names
    ``invariant_id`` (a copied check that reports under another ID would
    otherwise turn up in the wrong row)."""

    @functools.wraps(check)
    def checked(*args, **kwargs):
        out = check(*args, **kwargs)
        if isinstance(out, NotChecked):
            return out
        wrong = [v for v in out if v.invariant != invariant_id]
        if wrong:
            raise ValueError(f"{invariant_id}'s check returned a violation of {wrong[0].invariant}: {wrong[0]}")
        return out

    return checked


DOC_FULLY_SHARD = "fully_shard docstring (parameter groups: module.parameters() less those assigned by earlier calls; reshard_after_forward; the list form)"


DOC_REGISTER = "register_fsdp_forward_method docstring"
