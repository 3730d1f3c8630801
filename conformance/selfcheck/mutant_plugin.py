"""pytest plugin for mutant runs (conformance.selfcheck.mutants): the cheapest tests
most likely to catch a mutant of the given API run first, so that `-x` ends
a killed mutant early: the fake tier before the rank pool, and within a tier
the areas of the mutated API before the slow forward-method and parity tests;
a mutant's own `first` areas (its catalog entry) lead, on the pool."""

from __future__ import annotations

import os

ENV_VAR = "FSDP_CONFORMANCE_MUTANT_API"
FILE_VAR = "FSDP_CONFORMANCE_MUTANT_FILE"
FIRST_VAR = "FSDP_CONFORMANCE_MUTANT_FIRST"  # the catalog's first areas, comma-separated
# Files whose mutants change values (gradient reduction, parameter state),
# which only the rank pool's training checks see: parity first, by area
# before tier.
RUNTIME_FILES = ("_runtime_utils.py", "_fsdp_collectives.py", "_fsdp_param.py")
# Files one area exercises above all: that area's tests first.
AREA_FILES = {"clip_grad.py": "clip", "fully_sharded_data_parallel.py": "clip"}
# areas (test_<area>.py) in the order they run for a mutant of each API
ORDER = {
    "fsdp1": ("autowrap", "lora", "summon", "comm", "parity", "checkpoint", "schedule", "clip"),
    "fsdp2": ("fully_shard", "microbatch", "comm", "parity", "checkpoint", "schedule", "clip"),
    "forward_method": ("fully_shard", "parity"),
}
TIERS = ("fake", "gloo", "nccl")


def pytest_collection_modifyitems(session, config, items):
    order = ORDER.get(os.environ.get(ENV_VAR, ""))
    if not order:
        return
    file = os.environ.get(FILE_VAR, "")
    runtime = file.endswith(RUNTIME_FILES)
    if runtime:
        order = ("parity", *[a for a in order if a != "parity"])
    named = tuple(a for a in os.environ.get(FIRST_VAR, "").split(",") if a)
    first = named or tuple(a for f, a in AREA_FILES.items() if file.endswith(f))[:1]
    if first:  # values of these areas: their tests, on the pool, first
        runtime = True
        order = (*first, *[a for a in order if a not in first])

    def key(item):
        cs = getattr(item, "callspec", None)
        tier = cs.params.get("engine") if cs is not None else None
        area = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py").removeprefix("test_")
        t = TIERS.index(tier) if tier in TIERS else len(TIERS)
        a = order.index(area) if area in order else len(order)
        return (a, -t) if runtime else (t, a)  # runtime: the pool's tier first

    items.sort(key=key)  # stable: pytest's order within a key
