"""Violation: one disagreement between FSDP and the oracle (pure data)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Violation:
    invariant: str  # catalog ID, e.g. "WRAP-FQNS"
    message: str  # one line a person reads
    # Facts about the case and the disagreement, matched by known_failures.toml
    # ("policy:callable", "unit:root", "tie:cross-unit", "kind:missing-warning").
    tags: frozenset[str] = frozenset()

    def __str__(self) -> str:
        return f"[{self.invariant}] {self.message}"


def set_diff(got: set[str], want: set[str]) -> str:
    """'extra [...], missing [...]' for a message; 'the same' when equal."""
    parts = []
    if got - want:
        parts.append(f"extra {sorted(got - want)}")
    if want - got:
        parts.append(f"missing {sorted(want - got)}")
    return ", ".join(parts) or "the same"
