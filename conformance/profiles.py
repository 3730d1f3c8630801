"""Hypothesis profiles (dev, ci, thorough) and the one place that loads them."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

ENV_VAR = "FSDP_CONFORMANCE_PROFILE"
PROFILES = ("dev", "ci", "thorough")
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def _overrides() -> dict:
    """Run-wide settings from the environment, for runs that must draw alike
    (`change`: no example database replaying the other side's failures) or
    only need a first failure (mutants: no shrinking)."""
    from hypothesis import Phase

    out: dict = {}
    if os.environ.get("FSDP_CONFORMANCE_DATABASE") == "none":
        out["database"] = None
    if os.environ.get("FSDP_CONFORMANCE_SHRINK") == "0":
        out["phases"] = [p for p in Phase if p not in (Phase.shrink, Phase.explain)]
    return out


def register() -> None:
    extra = _overrides()
    settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=_SLOW_OK, **extra)
    # Hypothesis's own "ci" profile (derandomized, no database, print_blob)
    # with the suite's example budget.
    settings.register_profile(
        "ci",
        parent=settings.get_profile("ci"),
        max_examples=500,
        deadline=None,
        suppress_health_check=_SLOW_OK,
        **extra,
    )
    settings.register_profile("thorough", max_examples=3000, deadline=None, suppress_health_check=_SLOW_OK, **extra)


def selected(option: str | None = None) -> str:
    name = option or os.environ.get(ENV_VAR) or "dev"
    if name not in PROFILES:
        raise ValueError(f"unknown Hypothesis profile {name!r} (choose from {', '.join(PROFILES)})")
    return name


def activate(name: str) -> None:
    """Load ``name``. Import torch's test utilities first: importing them
    registers and loads torch's own profile, which must not win."""
    import torch.testing._internal.common_utils  # noqa: F401

    register()
    settings.load_profile(name)
