"""pytest plugin for mutant runs (conformance.mutants): the cheapest tests
most likely to catch a mutant of the given API run first, so that `-x` ends
a killed mutant early: the fake tier before the rank pool, and within a tier
the areas of the mutated API before the slow forward-method and parity tests."""

from __future__ import annotations

import os

ENV_VAR = "FSDP_CONFORMANCE_MUTANT_API"
# areas (test_<area>.py) in the order they run for a mutant of each API
ORDER = {
    "fsdp1": ("wrap", "frozen", "ties", "lora", "ranks", "forward_methods", "parity"),
    "fsdp2": ("fsdp2", "forward_methods", "parity"),
    "forward_method": ("forward_methods", "fsdp2", "parity"),
}
TIERS = ("fake", "gloo", "nccl")


def pytest_collection_modifyitems(session, config, items):
    order = ORDER.get(os.environ.get(ENV_VAR, ""))
    if not order:
        return

    def key(item):
        cs = getattr(item, "callspec", None)
        tier = cs.params.get("engine") if cs is not None else None
        area = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py").removeprefix("test_")
        return (TIERS.index(tier) if tier in TIERS else len(TIERS),
                order.index(area) if area in order else len(order))

    items.sort(key=key)  # stable: pytest's order within a key
