"""The conformance suite's Hypothesis profile is in force before its modules
are imported (their budgets scale with it), however the suite is collected:
`fsdp-conformance run`, this checkout's `pytest`, or `pytest --pyargs
conformance.suite` in another project."""

from conformance.plugin import ensure_profile


def pytest_configure(config):
    ensure_profile(config)
