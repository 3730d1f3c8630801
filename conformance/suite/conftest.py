"""The conformance suite's Hypothesis profile is in force before its modules
are imported (their budgets scale with it), however the suite is collected:
`fsdp-conformance run`, this checkout's `pytest`, or `pytest --pyargs
conformance.suite` in another project."""

import pytest

from conformance.plugin import ensure_profile
from conformance.suite.budget import FAKE_WORLD


def pytest_configure(config):
    ensure_profile(config)


@pytest.fixture(scope="module")
def fake_tier(engine):
    """The fake tier's engine only, at the world size the mesh strategies
    draw for (FAKE_WORLD): a structure test's; the module's value tests
    take the other tiers."""
    if engine.tier != "fake":
        pytest.skip(f"structure on the fake tier; the {engine.tier} tier checks it with the values (this module's value tests)")
    if engine.world_size != FAKE_WORLD:
        pytest.skip(f"the fake tier's world of {engine.world_size} ranks: the meshes drawn for it have {FAKE_WORLD}")
    return engine
