"""Violations as the invariants make them: one factory (the invariant, the
message, the case's tags and the kind of disagreement), and the tags every
value invariant adds."""

from __future__ import annotations

from conformance.case.violation import Violation


def backend_tag(obs) -> str:
    """The process group's backend, for the invariants that compare values with
    the reference (PARITY, MP-DTYPES, ACCUM, FSDP2-FROZEN, FWD-PARITY, FWD-ISOLATION): a known failure
    of one backend's collectives must not mask the others'."""
    return f"backend:{obs.backend}"


def violation(inv: str, msg: str, tags: set[str], *extra: str) -> Violation:
    return Violation(inv, msg, frozenset(tags | set(extra)))
