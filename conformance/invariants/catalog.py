"""The invariant catalog: ID, statement and spec source of every invariant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

S000 = "spec-sources/000 ([FSDP][6/N] Check valid param freezing for ModuleWrapPolicy, #104427)"
S004 = "spec-sources/004 ([RFC][FSDP2] register_fsdp_forward_method, #125394)"
DOC_FSDP = "FullyShardedDataParallel docstring (auto_wrap_policy, ignored_modules, use_orig_params)"


@dataclass(frozen=True)
class Invariant:
    id: str
    area: str  # test module / report group: wrap, frozen, ties, ...
    api: str  # fsdp1 | fsdp2
    statement: str
    source: str
    check: Callable  # (spec, prediction, observation) -> list[Violation]
    all_ranks: bool = False  # check gets every rank's observation, not rank 0's
    scenario: str = "fsdp1"  # the engine scenario that observes what it checks


CATALOG: dict[str, Invariant] = {}


def invariant(id: str, *, area: str, api: str, statement: str, source: str, all_ranks: bool = False, scenario: str = "fsdp1"):
    def register(fn: Callable) -> Callable:
        if id in CATALOG:
            raise ValueError(f"duplicate invariant {id}")
        CATALOG[id] = Invariant(id, area, api, statement, source, fn, all_ranks, scenario)
        return fn

    return register


class UnknownInvariant(KeyError):
    def __str__(self) -> str:
        return f"unknown invariant ID {self.args[0]!r} (known: {', '.join(sorted(CATALOG))})"


def get(invariant_id: str) -> Invariant:
    try:
        return CATALOG[invariant_id]
    except KeyError:
        raise UnknownInvariant(invariant_id) from None


def select(ids_or_areas: list[str] | None = None) -> list[Invariant]:
    """Invariants by ID or area; an unknown name raises UnknownInvariant."""
    if not ids_or_areas:
        return list(CATALOG.values())
    out = []
    for name in ids_or_areas:
        hits = [inv for inv in CATALOG.values() if name in (inv.id, inv.area)]
        if not hits:
            raise UnknownInvariant(name)
        out += [h for h in hits if h not in out]
    return out


# --- lifecycle (checkpoint): engine failures that can be known findings ---
# invariant ID -> fn(spec) -> tags of the case. A HANG or CRASH of such an
# invariant's example is matched against known_failures.toml as a violation
# tagged "kind:hang" / "kind:crash" plus these: a rank that torch itself
# kills (a segfault in a known code path) is then KNOWN, not CRASH.
ENGINE_FAILURE_TAGS: dict[str, Callable] = {}
