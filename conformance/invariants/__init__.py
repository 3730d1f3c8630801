"""The invariant catalog and its checks."""

from conformance.invariants import fsdp1  # noqa: F401  (registers the FSDP1 invariants)
from conformance.invariants import fsdp2, methods  # noqa: F401  (FSDP2, forward methods, PARITY)
from conformance.invariants import checkpoint  # noqa: F401,E402  (lifecycle: checkpoint invariants)
from conformance.invariants.catalog import CATALOG, Invariant, UnknownInvariant, get, select

__all__ = ["CATALOG", "Invariant", "UnknownInvariant", "get", "select"]
# --- training schedules (MP-DTYPES, ACCUM) ---
from conformance.invariants import training  # noqa: E402,F401
