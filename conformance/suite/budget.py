"""Per-test Hypothesis budgets for the pool-backed areas (FSDP2, forward
methods, parity), scaled from the active profile: ``examples(100)`` is 100
under the ci profile (500 examples), 6 under dev, 600 under thorough; an
explicit ``--max-examples N`` (profile "<name>-max<N>") is taken as is."""

from __future__ import annotations

from hypothesis import settings

# the fake tier's world the mesh strategies of the structure tests draw for
# (HSDP, TP and microbatch meshes); conftest's fake_tier skips any other
FAKE_WORLD = 4
CI_EXAMPLES = 500  # the ci profile's max_examples (conformance.run.profiles)


def examples(at_ci: int) -> int:
    budget = settings().max_examples
    if "-max" in (getattr(settings, "_current_profile", None) or ""):
        return budget
    return max(1, budget * at_ci // CI_EXAMPLES)
